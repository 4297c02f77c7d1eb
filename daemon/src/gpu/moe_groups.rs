//! A prompt chunk's resident MoE experts in groups ([`RunGroup`]): consecutive experts whose
//! tokens fit the chunk's scratch rows, multiplied in one dispatch a matrix
//! ([`super::GpuMoe::record_chunk_groups`]), and the words that tell the kernels each group's
//! experts and each token's outputs.

use super::moe::ExpertRun;

/// Consecutive runs of a chunk's resident experts whose entries span at most the chunk's
/// scratch rows: one gather, one product a matrix and one sum into the tokens for all of them
/// ([`super::GpuMoe::record_chunk_groups`]) instead of six dispatches an expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RunGroup {
    /// The group's first entry and the entries it spans (those of experts between its runs
    /// that are not resident are gathered too, and not used).
    pub first: usize,
    pub span: usize,
    /// Word of its runs (slot, first row in the span, rows) in the route buffer.
    pub runs_at: usize,
    pub n_runs: usize,
    /// The most entries of one run.
    pub max_count: usize,
    /// Word of its token list ([`super::Recorder::gather_add`]) and the tokens in it.
    pub list_at: usize,
    pub n_tokens: usize,
}

/// Groups `runs` (slot, first entry, entries; in order of their entries) whose entries span at
/// most `capacity` rows, and the words that describe them, to be written to the route buffer
/// from word `base`: each group's runs, then its tokens (`ids[entry]`, ascending), each token's
/// start in its entries, and the entries (rows of the span) in the runs' order.
pub(super) fn group_runs(
    runs: &[ExpertRun],
    ids: &[u32],
    capacity: usize,
    base: usize,
) -> Option<(Vec<u32>, Vec<RunGroup>)> {
    let (mut words, mut groups) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < runs.len() {
        let gf = runs[i].1;
        let mut j = i;
        while j < runs.len() && runs[j].1 >= gf && runs[j].1 + runs[j].2 - gf <= capacity {
            j += 1;
        }
        if j == i {
            return None; // one expert's tokens over the scratch
        }
        let g = &runs[i..j];
        let runs_at = base + words.len();
        for &(slot, first, count) in g {
            words.extend([slot as u32, (first - gf) as u32, count as u32]);
        }
        let mut pairs: Vec<(u32, u32)> = g
            .iter()
            .flat_map(|&(_, first, count)| {
                (first..first + count).map(|e| (ids[e], (e - gf) as u32))
            })
            .collect();
        // Stable: a token's entries stay in the runs' order.
        pairs.sort_by_key(|&(t, _)| t);
        let mut tokens: Vec<u32> = pairs.iter().map(|&(t, _)| t).collect();
        tokens.dedup();
        let list_at = base + words.len();
        words.extend(&tokens);
        let mut start = 0u32;
        let mut k = 0;
        for &t in &tokens {
            words.push(start);
            while k < pairs.len() && pairs[k].0 == t {
                k += 1;
                start += 1;
            }
        }
        words.push(start);
        words.extend(pairs.iter().map(|&(_, e)| e));
        let last = g[g.len() - 1];
        groups.push(RunGroup {
            first: gf,
            span: last.1 + last.2 - gf,
            runs_at,
            n_runs: g.len(),
            max_count: g.iter().map(|r| r.2).max().unwrap_or(0),
            list_at,
            n_tokens: tokens.len(),
        });
        i = j;
    }
    Some((words, groups))
}

/// Route words a chunk of `n` tokens may need beyond the routing's own: for [`group_runs`],
/// three a run, and for the entries a token each, a start each and themselves; for the layout
/// of a routing on the device (`Recorder::moe_sort`), two tables of three words an expert and
/// every token, its start and its entries.
pub(super) fn route_words_for(n: usize, k: usize, n_expert: usize) -> usize {
    let groups = 3 * n_expert + 3 * n * k + n_expert + 1;
    // Beyond the tokens and weights of the n·k entries, which the routing's words hold.
    let layout = super::ops::ChunkLayout::new(n, k, n_expert, 0, true);
    let sorted = layout.words(n, k) - 2 * n * k;
    groups.max(sorted)
}

#[cfg(test)]
mod tests {
    use super::group_runs;

    #[test]
    fn runs_are_grouped_within_the_scratch_rows_with_each_tokens_entries_listed() {
        // Entries 0..7 by expert: slot 3 has tokens 0, 2; slot 5 tokens 0, 1, 2; slot 9 token 1;
        // entries 6..7 are an expert that is not resident (no run); slot 1 tokens 2, 0.
        let ids = [0, 2, 0, 1, 2, 1, 7, 7, 2, 0];
        let runs = [(3, 0, 2), (5, 2, 3), (9, 5, 1), (1, 8, 2)];
        let (words, groups) = group_runs(&runs, &ids, 6, 100).unwrap();
        assert_eq!(groups.len(), 2);
        let (a, b) = (&groups[0], &groups[1]);
        assert_eq!((a.first, a.span, a.n_runs, a.max_count), (0, 6, 3, 3));
        assert_eq!((b.first, b.span, b.n_runs, b.max_count), (8, 2, 1, 2));
        let at = |w: usize| words[w - 100];
        let run = |g: &super::RunGroup, i: usize| {
            (0..3)
                .map(|j| at(g.runs_at + 3 * i + j))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(a, 0), [3, 0, 2]);
        assert_eq!(run(a, 1), [5, 2, 3]);
        assert_eq!(run(a, 2), [9, 5, 1]);
        assert_eq!(run(b, 0), [1, 0, 2]);
        // Group a: tokens 0, 1, 2; token 0 at entries 0 and 2, token 1 at 3 and 5, token 2 at
        // 1 and 4, each in the runs' order.
        assert_eq!(a.n_tokens, 3);
        let list: Vec<u32> = (0..3 + 4 + 6).map(|i| at(a.list_at + i)).collect();
        assert_eq!(list, [0, 1, 2, 0, 2, 4, 6, 0, 2, 3, 5, 1, 4]);
        // Group b's entries are rows of its own span.
        let list: Vec<u32> = (0..2 + 3 + 2).map(|i| at(b.list_at + i)).collect();
        assert_eq!(list, [0, 2, 0, 1, 2, 1, 0]);
        assert!(words.len() <= super::route_words_for(3, 3, 10));
        // An expert's tokens over the scratch rows: no groups.
        assert!(group_runs(&runs, &ids, 2, 0).is_none());
    }
}
