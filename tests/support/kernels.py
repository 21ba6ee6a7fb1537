"""OpenCL kernel sources shared by test modules."""

#: ``bump(x, by)``: ``x[i] += by`` — cheap, dependent, and easy to check.
COUNTER = """
__kernel void bump(__global uint *x, uint by) { x[get_global_id(0)] += by; }
"""
