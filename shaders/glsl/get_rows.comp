#version 450
// One row of a weight matrix to f32 (ggml's get_rows: the token embedding). One invocation per
// unit of 32 weights. The row is read on the device, from word `step_index` of the step buffer,
// so a recorded step can be replayed for each new token. A matrix larger than one binding is
// bound as runs of rows, one dispatch each; only the run that holds the row writes. A prompt's
// tokens are the workgroup rows (y): token t's row is word `step_index + t`, written at `t * n`.

layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
layout(std430, binding = 1) writeonly buffer Output { float dst[]; };
layout(std430, binding = 2) readonly buffer Step { uint step[]; };

layout(push_constant) uniform Params {
    uint n;         // row width
    uint row_bytes;
    uint first_row; // the first row of the bound range
    uint n_rows;    // rows in the bound range
    uint w_offset;  // byte offset of `first_row` in `weights`
    uint step_index;
} p;

#include "common.glsl"
#include "decode.glsl"

void main() {
    const uint t = gl_WorkGroupID.y;
    const uint row = step[p.step_index + t];
    const uint u = gl_GlobalInvocationID.x;
    if (row < p.first_row || row - p.first_row >= p.n_rows || u >= p.n / 32u) {
        return;
    }
    float v[32];
    decode_unit(p.w_offset + (row - p.first_row) * p.row_bytes, u, v);
    for (uint i = 0u; i < 32u; ++i) {
        dst[t * p.n + 32u * u + i] = v[i];
    }
}
