"""Structured outputs: grammars (xgrammar, imported on first use) that constrain a request's
tokens, compiled off the engine loop and applied as token bitmasks in the sampler."""
