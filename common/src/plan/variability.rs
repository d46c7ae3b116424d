//! A machine's variability in the plan. Equal work does not take equal time (other jobs, a
//! VM's neighbours, the clock's boost), and ranks that meet wait for the slowest: a pipeline
//! stage for the micro-batch its neighbour hands on late, a layer's tensor-parallel shards at
//! each of their collectives, the replicas at the gradients' average. A timeline of mean passes
//! leaves those waits out, and comes out short by them. Here the passes' lengths are drawn
//! around their means with the relative spread the profile measured (`Profile::spread`), the
//! timeline run for each draw, and the step's expected length taken: the timelines' mean, plus
//! the replicas' wait for the slowest of them. The draws are seeded: a plan is the same every
//! time.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::timeline::{self, Sharing, StageCosts};
use crate::pipeline::{Placement, Schedule};

/// Timelines drawn per layout: the mean's own error is about spread/√DRAWS of a pass, small
/// beside the spread itself; a plan of thousands of layouts stays within seconds.
pub const DRAWS: usize = 32;

/// A pass's length over its mean: log-normal with mean 1 and relative standard deviation
/// `spread` (never negative, as a normal draw could be; slow passes outlast fast ones, as
/// measured passes do).
struct PassLengths {
    rng: ChaCha8Rng,
    /// The logarithm's standard deviation and mean.
    sigma: f64,
    mu: f64,
}

impl PassLengths {
    fn new(spread: f64, seed: u64) -> PassLengths {
        let variance = (1.0 + spread * spread).ln();
        PassLengths { rng: ChaCha8Rng::seed_from_u64(seed), sigma: variance.sqrt(), mu: -variance / 2.0 }
    }

    fn standard_normal(&mut self) -> f64 {
        // Box–Muller; 1 − u keeps the logarithm's argument in (0, 1].
        let (u, v): (f64, f64) = (self.rng.random(), self.rng.random());
        (-2.0 * (1.0 - u).ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    fn next(&mut self) -> f64 {
        (self.mu + self.sigma * self.standard_normal()).exp()
    }
}

/// A replica's step on a varying machine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Varied {
    /// The timeline's mean over the draws.
    pub mean_s: f64,
    /// Its standard deviation.
    pub sd_s: f64,
}

/// One replica's timeline (as [`timeline::simulate`]) with each pass drawn around its mean
/// with relative standard deviation `spread`; a pass that `shards` tensor-parallel ranks run
/// together lasts as long as the slowest shard's draw.
pub fn replica_timeline(
    schedule: Schedule,
    placement: Placement,
    micro_batches: usize,
    costs: &StageCosts,
    sharing: &Sharing,
    spread: f64,
    shards: usize,
) -> Varied {
    let seconds: Vec<f64> = (0..DRAWS as u64)
        .map(|draw| {
            let mut lengths = PassLengths::new(spread, draw);
            let mut vary = |_| (0..shards.max(1)).map(|_| lengths.next()).fold(0.0, f64::max);
            timeline::simulate_varied(schedule, placement, micro_batches, costs, sharing, &mut vary).seconds
        })
        .collect();
    let mean_s = seconds.iter().sum::<f64>() / DRAWS as f64;
    let variance = seconds.iter().map(|s| (s - mean_s).powi(2)).sum::<f64>() / (DRAWS - 1) as f64;
    Varied { mean_s, sd_s: variance.sqrt() }
}

/// E[max of `n` independent standard normals]: how many standard deviations past their mean
/// the slowest of `n` equal ranks ends. 0 for one rank, 1/√π for two, about 1.42 for 8 and
/// 2.34 for 64. The integral ∫ x·n·φ(x)·Φ(x)^(n−1) dx, numerically.
pub fn expected_slowest(n: usize) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    const STEP: f64 = 1e-3;
    let density = |x: f64| (-x * x / 2.0).exp() / (std::f64::consts::TAU).sqrt();
    (-8000..=8000)
        .map(|i| {
            let x = i as f64 * STEP;
            x * n as f64 * density(x) * normal_cdf(x).powi(n as i32 - 1) * STEP
        })
        .sum()
}

/// Φ(x), from the error function's approximation 7.1.26 of Abramowitz and Stegun (error under
/// 1.5e-7).
fn normal_cdf(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.3275911 * z);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    let erf = 1.0 - poly * (-z * z).exp();
    if x >= 0.0 {
        (1.0 + erf) / 2.0
    } else {
        (1.0 - erf) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_of_n_normals_ends_where_order_statistics_say() {
        // Published values of E[max of n standard normals].
        for (n, expected) in [(1, 0.0), (2, 0.5642), (3, 0.8463), (4, 1.0294), (8, 1.4236), (50, 2.2491), (100, 2.5076)] {
            assert!((expected_slowest(n) - expected).abs() < 1e-3, "n {n}: {} against {expected}", expected_slowest(n));
        }
    }

    #[test]
    fn pass_lengths_have_mean_one_and_the_spread_asked() {
        let mut lengths = PassLengths::new(0.2, 7);
        let draws: Vec<f64> = (0..20_000).map(|_| lengths.next()).collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        let sd = (draws.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / draws.len() as f64).sqrt();
        assert!((mean - 1.0).abs() < 0.01 && (sd - 0.2).abs() < 0.01, "mean {mean}, sd {sd}");
        assert!(draws.iter().all(|&d| d > 0.0));
    }

    fn two_stages() -> StageCosts {
        StageCosts::new(vec![1.0, 1.0], vec![2.0, 2.0], 0.0)
    }

    #[test]
    fn without_spread_the_timeline_is_the_mean_passes_one() {
        let costs = two_stages();
        let plain = timeline::simulate(Schedule::OneFOneB, Placement::one_stage_each(2), 4, &costs, &Sharing::none());
        let varied = replica_timeline(Schedule::OneFOneB, Placement::one_stage_each(2), 4, &costs, &Sharing::none(), 0.0, 2);
        assert_eq!((varied.mean_s, varied.sd_s), (plain.seconds, 0.0));
    }

    /// One stage: its passes back to back, whose lengths' mean is the sum of the means; a
    /// pipeline's stages wait for each other's late passes, so its mean outlasts the mean
    /// passes' timeline; shards that wait for the slowest at every pass, more so.
    #[test]
    fn waiting_for_each_other_lengthens_a_pipeline_not_a_lone_stage() {
        let one = StageCosts::new(vec![1.0], vec![2.0], 0.0);
        let lone = replica_timeline(Schedule::GPipe, Placement::one_stage_each(1), 8, &one, &Sharing::none(), 0.2, 1);
        assert!((lone.mean_s / 24.0 - 1.0).abs() < 0.03, "{lone:?}");
        // Eight passes of sd 0.2·(1 or 2): the sum's sd is 0.2·√(4·1 + 4·4)... of 8 passes.
        let sum_sd = 0.2 * (8.0f64 * (1.0 + 4.0) / 2.0 * 2.0).sqrt();
        assert!((lone.sd_s / sum_sd - 1.0).abs() < 0.35, "{lone:?} against {sum_sd}");

        let costs = two_stages();
        let plain = timeline::simulate(Schedule::OneFOneB, Placement::one_stage_each(2), 8, &costs, &Sharing::none()).seconds;
        let pipeline = replica_timeline(Schedule::OneFOneB, Placement::one_stage_each(2), 8, &costs, &Sharing::none(), 0.2, 1);
        let sharded = replica_timeline(Schedule::OneFOneB, Placement::one_stage_each(2), 8, &costs, &Sharing::none(), 0.2, 2);
        assert!(pipeline.mean_s > plain * 1.03, "{pipeline:?} against {plain}");
        assert!(sharded.mean_s > pipeline.mean_s * 1.05, "{sharded:?} against {pipeline:?}");
        // Each sharded pass is the later of two draws: about 1 + 0.2/√π of its mean at most.
        assert!(sharded.mean_s < plain * (1.0 + 0.2 * 0.5642) * 1.1, "{sharded:?}");
    }
}
