#version 450
#if defined(USE_SUBGROUP)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
// y[r] = row_r(W) · x for quantized rows (decode: a batch of one), NROWS rows per workgroup.
// Each invocation takes units of 32 weights in turn, so neighbours read neighbouring blocks; the
// 32 inputs of a unit are loaded once and used for every row of the workgroup, and a workgroup
// has NROWS rows of work between its reductions instead of one. Workgroups come in a 2-D grid
// because a vocabulary can exceed the 65535 groups of one dimension.
//
// With INDEXED (ggml's mul_mat_vec_id): `weights` is a stack of experts of `n_rows` rows each and
// the expert is read on the device, `ids[rank + z]` for workgroup layer z, so the routing need not
// come back to the host. Layer z reads x at `z * x_stride` and writes y at `y_offset + z *
// y_stride`: the k experts of a token are one dispatch.

#define WG 64u
#define NROWS 4u
layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Weights { uint weights[]; };
layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };
#if defined(INDEXED)
layout(std430, binding = 3) readonly buffer Ids { uint ids[]; };
#endif

layout(push_constant) uniform Params {
    uint n_in;
    uint n_rows;
    uint w_offset; // byte offset of row 0 in `weights`
    uint y_offset; // element offset of row 0's result in `y`
#if defined(INDEXED)
    uint rank;     // index in `ids` of layer 0's expert
    uint x_stride; // floats from one layer's input to the next
    uint y_stride; // floats from one layer's results to the next
#endif
} p;

#include "common.glsl"
#include "decode.glsl"
#include "reduce.glsl"

void main() {
    const uint r0 = NROWS * (gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x);
    if (r0 >= p.n_rows) {
        return; // whole workgroups leave together, so the barriers below stay uniform
    }
    const uint nr = min(NROWS, p.n_rows - r0);
    const uint rb = row_bytes(p.n_in);
#if defined(INDEXED)
    const uint z = gl_WorkGroupID.z;
    const uint w0 = p.w_offset + ids[p.rank + z] * p.n_rows * rb;
    const uint x0 = z * p.x_stride;
    const uint y0 = p.y_offset + z * p.y_stride;
#else
    const uint w0 = p.w_offset;
    const uint x0 = 0u;
    const uint y0 = p.y_offset;
#endif
    float acc[NROWS];
    for (uint j = 0u; j < NROWS; ++j) {
        acc[j] = 0.0;
    }
    float v[32];
    float xv[32];
    for (uint u = gl_LocalInvocationID.x; u < p.n_in / 32u; u += WG) {
        for (uint i = 0u; i < 32u; ++i) {
            xv[i] = x[x0 + 32u * u + i];
        }
        for (uint j = 0u; j < nr; ++j) {
            decode_unit(w0 + (r0 + j) * rb, u, v);
            float a = acc[j];
            for (uint i = 0u; i < 32u; ++i) {
                a += v[i] * xv[i];
            }
            acc[j] = a;
        }
    }
    for (uint j = 0u; j < NROWS; ++j) {
        const float s = wg_sum(acc[j]);
        if (gl_LocalInvocationID.x == 0u && j < nr) {
            y[y0 + r0 + j] = s;
        }
    }
}
