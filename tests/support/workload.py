"""A long dependent workload: each launch reads what the previous one wrote,
on buffers holding fixed weights and evolving state; every few steps the
application reads a checksum back and feeds it into later launches, so a
lost, repeated or re-ordered command or reply changes the final result.

Four programs (the compute logic), one weights buffer (fixed data), two
state buffers (intermediate state) and the application's own variables.
"""

from __future__ import annotations

import hashlib

import numpy as np

from accelmig.agent.driver import u32

PROGRAMS = [
    """__kernel void step_mix(__global const uint *w, __global const uint *s, __global uint *t, uint k) {
        uint i = get_global_id(0), n = get_global_size(0);
        t[i] = s[i] * 1664525u + w[(i + k) % 65536u] + (s[(i + 1) % n] >> 3) + k; }""",
    """__kernel void step_rotate(__global const uint *w, __global const uint *s, __global uint *t, uint k) {
        uint i = get_global_id(0), n = get_global_size(0);
        uint v = s[(i + k) % n]; t[i] = (v << 7 | v >> 25) ^ w[i % 65536u]; }""",
    """__kernel void step_fold(__global const uint *w, __global const uint *s, __global uint *t, uint k) {
        uint i = get_global_id(0), n = get_global_size(0);
        t[i] = s[i] ^ (s[n - 1 - i] * 2654435761u) ^ w[(k * 7u + i) % 65536u]; }""",
    """__kernel void checksum(__global const uint *s, __global uint *out, uint n) {
        uint acc = 2166136261u;
        for (uint i = 0; i < n; i++) acc = (acc ^ s[i]) * 16777619u;
        out[0] = acc; }""",
]
KERNELS = ["step_mix", "step_rotate", "step_fold"]
N_STATE = 4096
WEIGHTS = np.random.default_rng(20261202).integers(0, 2**32, 65536, dtype=np.uint32)
WEIGHT_BYTES = WEIGHTS.nbytes + N_STATE * 4


class Workload:
    def __init__(self, dev):
        self.dev = dev
        self.programs = [dev.build(src) for src in PROGRAMS]
        self.weights = dev.upload(WEIGHTS)
        self.state = [dev.upload(np.arange(N_STATE, dtype=np.uint32)), dev.alloc(N_STATE * 4)]
        self.sum_buf = dev.alloc(4)
        self.step = 0
        self.feedback = 0          # an application variable fed by replies
        self.checksums: list[int] = []

    def run(self, launches: int, check_every: int = 50, on_step=None) -> str:
        for _ in range(launches):
            k = self.step
            prog = self.programs[k % 3]
            cur, nxt = self.state[k % 2], self.state[(k + 1) % 2]
            prog.launch(KERNELS[k % 3], N_STATE, None, self.weights, cur, nxt,
                        u32((k + self.feedback) % 2**32))
            self.step += 1
            if self.step % check_every == 0:
                self.programs[3].launch("checksum", 1, None, nxt, self.sum_buf, u32(N_STATE))
                value = int(np.frombuffer(self.dev.read(self.sum_buf), dtype=np.uint32)[0])
                self.checksums.append(value)
                self.feedback = value % 1000
            if on_step is not None:
                on_step(self.step)
        final = self.dev.read(self.state[self.step % 2])
        return hashlib.sha256(final + repr(self.checksums).encode()).hexdigest()
