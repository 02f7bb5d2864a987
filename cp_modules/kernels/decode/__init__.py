"""Paged decode attention with LSE: GQA/MHA, absorbed MLA, and the Gluon (Hopper) MLA kernel."""
