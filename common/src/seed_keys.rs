//! Keys for seeded randomness: a run's seed mixed with where the randomness is used (a step, a
//! micro-batch, a layer), so that every such place draws its own stream, the same whatever the
//! layout or the schedule that reaches it. Below the loop, the models and the pipeline, which
//! all key their randomness so.

/// A 64-bit key mixing `parts` (SplitMix64's finaliser over each part in turn): nearby inputs
/// give unrelated keys.
pub fn mix_key(parts: &[u64]) -> u64 {
    parts.iter().fold(0x9e37_79b9_7f4a_7c15u64, |acc, &part| {
        let mut z = (acc ^ part).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}
