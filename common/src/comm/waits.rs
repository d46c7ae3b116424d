//! Who the ranks waited for: each rank's time in the gradients' averaging, gathered at the end
//! of training. A collective ends for every rank when the last one arrives, so a rank that is
//! slow (a loaded or throttled node, a rank stopped for a while) spends the least time in it and
//! the others the most: the difference is how long they waited for it. A slow link between
//! nodes slows the collective for every rank alike and shows in the times, not in the spread.
use anyhow::Result;
use tch::Tensor;

use super::group::ProcessGroup;
use super::ReduceOp;

/// Below this spread (seconds, and share of the longest time) no rank is said to be waited for:
/// the ranks' own step times differ that much anyway.
const WAITED_AT_LEAST_S: f64 = 0.2;
const WAITED_AT_LEAST_SHARE: f64 = 0.25;

/// Every rank's `seconds`, by rank of `group` (every rank of the group calls it).
pub fn gather(group: &ProcessGroup, seconds: f64) -> Result<Vec<f64>> {
    if group.world_size() == 1 {
        return Ok(vec![seconds]);
    }
    // A sum of one-hot vectors: one small all-reduce, which every engine has for float64.
    let mut mine = vec![0.0; group.world_size()];
    mine[group.rank()] = seconds;
    let mut all = Tensor::from_slice(&mine);
    group.all_reduce(&mut all, ReduceOp::Sum)?;
    Ok(Vec::<f64>::try_from(&all)?)
}

/// The rank the others waited for, if one stands out: `(rank, how long they waited)`.
pub fn waited_for(seconds: &[f64]) -> Option<(usize, f64)> {
    if seconds.len() < 2 {
        return None;
    }
    let (least, min) = seconds.iter().copied().enumerate().min_by(|a, b| a.1.total_cmp(&b.1))?;
    let max = seconds.iter().copied().fold(f64::MIN, f64::max);
    let spread = max - min;
    (spread >= WAITED_AT_LEAST_S && spread >= WAITED_AT_LEAST_SHARE * max).then_some((least, spread))
}

/// One line: each rank's time in the averaging, and who the others waited for.
pub fn describe(seconds: &[f64], group: &ProcessGroup) -> Option<String> {
    if seconds.len() < 2 {
        return None;
    }
    // Job ranks and their hosts where this group is the job's (not a parameter-server split).
    let whole_job = group.world_size() == group.env().world_size;
    let name = |rank: usize| if whole_job { super::hosts::number_on_host(rank) } else { rank.to_string() };
    let each: Vec<String> = seconds.iter().enumerate().map(|(rank, s)| format!("{} {s:.2} s", name(rank))).collect();
    let verdict = match waited_for(seconds) {
        Some((rank, waited)) => format!("the others waited for rank {} (up to {waited:.2} s longer in it)", name(rank)),
        None => "no rank kept the others waiting".into(),
    };
    Some(format!("time in the gradients' averaging by rank: {}; {verdict}", each.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_that_spent_the_least_is_the_one_waited_for() {
        assert_eq!(waited_for(&[3.4, 0.3, 3.1]), Some((1, 3.4 - 0.3)));
        // Ranks that differ by their own noise: nobody is blamed.
        assert_eq!(waited_for(&[1.0, 0.9, 1.05]), None);
        assert_eq!(waited_for(&[0.15, 0.01]), None, "under 0.2 s is noise");
        assert_eq!(waited_for(&[2.0]), None);
    }
}
