//! How a step of the worker ([`super::worker`]) is shared between the requests decoding and
//! the prompts going into the steps (`Sequences::mixed_step_tokens`).

/// Tokens each running request puts into the next step, in the order of `prompts`, which
/// holds for each the prompt tokens it has left to go into the steps (`None`: it is decoding).
/// A decoding request puts its next token. The prompts take what is left of the step's
/// `room` (the oldest first), but while one waits the decoding requests take at most half of
/// it, in turns from `turn` (one left out steps next time): otherwise a request admitted beside
/// many running ones would get a token or two a step and wait many steps for its first. The
/// step's tokens are as many either way. `room` 0 (the engine stopped taking prompts into its
/// steps, its chunk's memory refused since): every request steps and each prompt goes whole.
pub(super) fn step_tokens(prompts: &[Option<usize>], room: usize, turn: usize) -> Vec<usize> {
    let pending: usize = prompts.iter().flatten().sum();
    let room = match room {
        0 => usize::MAX,
        r => r,
    };
    let decoding: Vec<usize> = (0..prompts.len())
        .filter(|&i| prompts[i].is_none())
        .collect();
    let cap = match pending {
        0 => decoding.len(),
        _ => decoding.len().min(room - pending.min(room / 2)),
    };
    let mut taken = vec![0; prompts.len()];
    for j in 0..cap {
        taken[decoding[(turn + j) % decoding.len()]] = 1;
    }
    let mut left = room.saturating_sub(cap);
    for (i, p) in prompts.iter().enumerate() {
        if let Some(p) = p {
            taken[i] = (*p).min(left);
            left -= taken[i];
        }
    }
    taken
}

#[cfg(test)]
mod tests {
    use super::step_tokens;

    #[test]
    fn a_step_gives_a_waiting_prompt_at_least_half_its_room() {
        // Decoding requests alone: each its token, whatever the room.
        assert_eq!(step_tokens(&[None, None, None], 8, 0), [1, 1, 1]);
        assert_eq!(step_tokens(&[None; 10], 8, 3), [1; 10]);
        // A prompt beside few decoders takes the rest of the room; the oldest prompt first.
        assert_eq!(step_tokens(&[None, Some(32), None], 8, 0), [1, 6, 1]);
        assert_eq!(step_tokens(&[Some(3), Some(32)], 8, 0), [3, 5]);
        assert_eq!(step_tokens(&[Some(2), None], 8, 0), [2, 1]);
        // Beside seven decoders a prompt still gets half the room; they take turns.
        let prompts = [None, None, None, None, None, None, None, Some(32)];
        assert_eq!(step_tokens(&prompts, 8, 0), [1, 1, 1, 1, 0, 0, 0, 4]);
        assert_eq!(step_tokens(&prompts, 8, 4), [1, 0, 0, 0, 1, 1, 1, 4]);
        assert_eq!(step_tokens(&prompts, 8, 5), [1, 1, 0, 0, 0, 1, 1, 4]);
        // A prompt's last tokens leave the rest to the decoders.
        let prompts = [None, None, None, None, None, None, None, Some(2)];
        assert_eq!(step_tokens(&prompts, 8, 0), [1, 1, 1, 1, 1, 1, 0, 2]);
        // No room: every request steps, each prompt whole.
        assert_eq!(step_tokens(&[None, Some(40), None], 0, 0), [1, 40, 1]);
    }
}
