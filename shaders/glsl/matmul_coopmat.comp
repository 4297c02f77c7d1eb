#version 450
// C = A * B for f16 A (M×K, row-major) and B (K×N, row-major), f32 C, one 16×16 tile of C per
// subgroup, using cooperative matrices (VK_KHR_cooperative_matrix). M, N, K multiples of 16.
// Compiled for every build; used only on devices that report 16×16×16 f16→f32 support.

#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require

layout(local_size_x_id = 0) in; // = subgroup size, one subgroup per workgroup

layout(std430, binding = 0) readonly buffer A { float16_t a[]; };
layout(std430, binding = 1) readonly buffer B { float16_t b[]; };
layout(std430, binding = 2) writeonly buffer C { float c[]; };

layout(push_constant) uniform Params {
    uint m;
    uint n;
    uint k;
} p;

void main() {
    const uint tile_row = gl_WorkGroupID.y * 16u;
    const uint tile_col = gl_WorkGroupID.x * 16u;

    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc =
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);

    for (uint kk = 0u; kk < p.k; kk += 16u) {
        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma;
        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
        coopMatLoad(ma, a, tile_row * p.k + kk, p.k, gl_CooperativeMatrixLayoutRowMajor);
        coopMatLoad(mb, b, kk * p.n + tile_col, p.n, gl_CooperativeMatrixLayoutRowMajor);
        acc = coopMatMulAdd(ma, mb, acc);
    }
    coopMatStore(acc, c, tile_row * p.n + tile_col, p.n, gl_CooperativeMatrixLayoutRowMajor);
}
