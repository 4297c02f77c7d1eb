// Workgroup-wide sum and max through shared memory; every invocation must call them (they
// contain barriers). WG must be the workgroup size, a power of two.

shared float red[WG];

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
