"""Dense and state-space ops: each module holds its Triton kernel(s), a torch reference and a
dispatcher. Import from the modules (`from krait.ops.rms_norm import rms_norm`); nothing is
re-exported here, so that a module and its same-named function never shadow each other."""
