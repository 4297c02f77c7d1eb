#version 450
// Adds each row of `y` to the row of `x` its token names, scaled: x[ids[first + i]] +=
// w[first + i] * y[i] for i in 0..count (one MoE expert's outputs for the tokens of a prompt's
// chunk that chose it; a token appears at most once in an expert's run, so no two rows of a
// dispatch write the same row of x). The ids and weights are one buffer: ids from word 0, the
// weights' f32 bits from word `weights_at`. Rows are grid y.

layout(local_size_x = 256) in;

layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer Y { float y[]; };
layout(std430, binding = 2) readonly buffer Route { uint route[]; };

#if defined(GATHER)
// With GATHER, several experts' outputs at once (a group of runs, whose tokens may repeat
// across runs): x[t] += Σ w[first + e] * y[e] over the entries e the list gives token t, added
// in the list's order (the runs' order, as one dispatch per run would). The list, from word
// `list_at` of the route buffer: the group's n_tokens tokens, then n_tokens + 1 starts, then the
// entries (rows of y, from the group's first entry). Tokens are grid y.
layout(push_constant) uniform Params {
    uint n;
    uint first;
    uint weights_at;
    uint list_at;
    uint n_tokens;
} p;

void main() {
    const uint i = gl_WorkGroupID.y;
    const uint k = gl_GlobalInvocationID.x;
    if (k >= p.n) {
        return;
    }
    const uint t = route[p.list_at + i];
    const uint starts = p.list_at + p.n_tokens;
    const uint entries = starts + p.n_tokens + 1u;
    float acc = x[t * p.n + k];
    for (uint j = route[starts + i]; j < route[starts + i + 1u]; ++j) {
        const uint e = route[entries + j];
        acc += uintBitsToFloat(route[p.weights_at + p.first + e]) * y[e * p.n + k];
    }
    x[t * p.n + k] = acc;
}
#else
layout(push_constant) uniform Params {
    uint n;          // row width
    uint first;      // the run's first entry
    uint weights_at; // word of entry 0's weight
} p;

void main() {
    const uint i = gl_WorkGroupID.y;
    const uint k = gl_GlobalInvocationID.x;
    if (k >= p.n) {
        return;
    }
    const uint t = route[p.first + i];
    const float w = uintBitsToFloat(route[p.weights_at + p.first + i]);
    x[t * p.n + k] += w * y[i * p.n + k];
}
#endif
