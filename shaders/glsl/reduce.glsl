// Workgroup-wide sum and max; every invocation must call them, in uniform control flow (they
// contain barriers). WG must be the workgroup size, a power of two. With USE_SUBGROUP each
// subgroup reduces with one instruction and shared memory only joins the subgroups' results.

shared float red[WG];

#if defined(USE_SUBGROUP)
float wg_sum(float v) {
    v = subgroupAdd(v);
    if (subgroupElect()) {
        red[gl_SubgroupID] = v;
    }
    barrier();
    float r = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; ++i) {
        r += red[i];
    }
    barrier();
    return r;
}

float wg_max(float v) {
    v = subgroupMax(v);
    if (subgroupElect()) {
        red[gl_SubgroupID] = v;
    }
    barrier();
    float r = red[0];
    for (uint i = 1u; i < gl_NumSubgroups; ++i) {
        r = max(r, red[i]);
    }
    barrier();
    return r;
}
#else

float wg_sum(float v) {
    red[gl_LocalInvocationID.x] = v;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (gl_LocalInvocationID.x < s) {
            red[gl_LocalInvocationID.x] += red[gl_LocalInvocationID.x + s];
        }
        barrier();
    }
    const float r = red[0];
    barrier();
    return r;
}

float wg_max(float v) {
    red[gl_LocalInvocationID.x] = v;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (gl_LocalInvocationID.x < s) {
            red[gl_LocalInvocationID.x] = max(red[gl_LocalInvocationID.x], red[gl_LocalInvocationID.x + s]);
        }
        barrier();
    }
    const float r = red[0];
    barrier();
    return r;
}
#endif
