#version 450
// A prompt chunk's MoE routing laid out by expert, on the device, for the grouped products
// (`matvec_batch.comp` with GROUPED) and the gathered sum (`scatter_add.comp` with GATHER), as
// the host's `ChunkRouting` and `group_runs` would write them. One workgroup.
//
// `sel` holds each of the n_tok tokens' routing from `moe_route.comp` with CHUNK: k expert ids
// (as uint bits), then k weights. Entry (t, r), the token's r-th expert, takes a row of its
// expert's run: the runs follow each other in expert order, a run's rows in no set order (they
// are placed with atomics; every row is computed alone, so the order changes no result). The
// route buffer receives:
// - words 0..n_tok·k: each entry row's token;
// - words weights_at..: each entry row's weight (float bits);
// - words runs_at..: for each expert, its slot, its first row and its rows (0 for an expert no
//   token chose). Where `host_runs_at` is not 0 some experts have no VRAM slot (`slot_of[
//   map_offset + e]`, 0xFFFFFFFF for none): their runs here have no rows, and a second table
//   at host_runs_at gives every expert's run in the stacks in system RAM (slot = the expert),
//   with rows only for those without a slot. Without it every expert is resident, slot = expert;
// - words list_at..: the tokens 0..n_tok, their starts t·k (n_tok + 1 words), then for each
//   token its k entry rows in rank order: the gathered sum adds a token's experts in the order
//   the decode step does.
// `counts[counts_at + e]` (host-visible) receives expert e's rows, for the host's counters.

#define WG 256u
#define MAX_EXPERTS 256u
layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer Sel { uint sel[]; };
layout(std430, binding = 1) writeonly buffer Route { uint route[]; };
layout(std430, binding = 2) writeonly buffer Counts { uint counts[]; };
layout(std430, binding = 3) readonly buffer SlotOf { uint slot_of[]; };

layout(push_constant) uniform Params {
    uint n_tok;
    uint k;
    uint n_expert; // at most MAX_EXPERTS
    uint weights_at;
    uint runs_at;
    uint list_at;
    uint counts_at;
    uint host_runs_at; // 0: every expert resident
    uint map_offset;   // index in `slot_of` of expert 0's slot (with host_runs_at)
} p;

shared uint rows[MAX_EXPERTS];
shared uint cursor[MAX_EXPERTS];

void main() {
    const uint i = gl_LocalInvocationID.x;
    const uint n = p.n_tok * p.k;
    for (uint e = i; e < p.n_expert; e += WG) {
        rows[e] = 0u;
    }
    barrier();
    for (uint j = i; j < n; j += WG) {
        const uint t = j / p.k, r = j % p.k;
        atomicAdd(rows[sel[t * 2u * p.k + r]], 1u);
    }
    barrier();
    if (i == 0u) {
        uint at = 0u;
        for (uint e = 0u; e < p.n_expert; ++e) {
            cursor[e] = at;
            at += rows[e];
        }
    }
    barrier();
    for (uint e = i; e < p.n_expert; e += WG) {
        const uint slot = p.host_runs_at != 0u ? slot_of[p.map_offset + e] : e;
        const bool resident = slot != 0xFFFFFFFFu;
        route[p.runs_at + 3u * e] = resident ? slot : 0u;
        route[p.runs_at + 3u * e + 1u] = cursor[e];
        route[p.runs_at + 3u * e + 2u] = resident ? rows[e] : 0u;
        if (p.host_runs_at != 0u) {
            route[p.host_runs_at + 3u * e] = e;
            route[p.host_runs_at + 3u * e + 1u] = cursor[e];
            route[p.host_runs_at + 3u * e + 2u] = resident ? 0u : rows[e];
        }
        counts[p.counts_at + e] = rows[e];
    }
    const uint starts = p.list_at + p.n_tok;
    const uint entries = starts + p.n_tok + 1u;
    for (uint t = i; t <= p.n_tok; t += WG) {
        if (t < p.n_tok) {
            route[p.list_at + t] = t;
        }
        route[starts + t] = t * p.k;
    }
    barrier();
    for (uint j = i; j < n; j += WG) {
        const uint t = j / p.k, r = j % p.k;
        const uint base = t * 2u * p.k;
        const uint row = atomicAdd(cursor[sel[base + r]], 1u);
        route[row] = t;
        route[p.weights_at + row] = sel[base + p.k + r];
        route[entries + j] = row;
    }
}
