"""Speculative decoding: the lossless rejection-sampling verifier and the n-gram drafter."""
