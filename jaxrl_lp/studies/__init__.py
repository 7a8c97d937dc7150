"""Numerics studies built into the library (SPEC section 7): Fair Cast and ternary export."""
