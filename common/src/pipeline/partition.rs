//! Which encoder layers each pipeline stage runs. Stage 0 also embeds the tokens and the last
//! stage also computes the logits, as in the course (encoder on the first device, decoder on
//! the last); every stage gets at least one encoder layer.
use std::ops::Range;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::error::usage;

/// Consecutive ranges of encoder layers, one per stage, covering `0..nlayers` in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    pub layers: Vec<Range<i64>>,
}

/// Measured (or estimated) cost of each piece of the model, in any unit (seconds of forward
/// and backward per micro-batch): what [`Partition::balanced`] evens out.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCosts {
    pub embedding: f64,
    pub layers: Vec<f64>,
    pub head: f64,
}

impl Partition {
    /// `nlayers` layers split by count: the first `nlayers % stages` stages take one more.
    pub fn even(nlayers: i64, stages: usize) -> Result<Partition> {
        check(nlayers, stages)?;
        let (base, extra) = (nlayers / stages as i64, nlayers % stages as i64);
        let mut start = 0;
        let layers = (0..stages as i64)
            .map(|s| {
                let len = base + i64::from(s < extra);
                start += len;
                start - len..start
            })
            .collect();
        Ok(Partition { layers })
    }

    /// The split whose slowest stage is fastest (the embedding counted on stage 0, the output
    /// layer on the last), found exactly by dynamic programming over the split points; ties go
    /// to the split closest to [`Partition::even`]'s (earlier stages longer).
    pub fn balanced(costs: &LayerCosts, stages: usize) -> Result<Partition> {
        let n = costs.layers.len();
        check(n as i64, stages)?;
        // prefix[i] = cost of layers 0..i.
        let prefix: Vec<f64> = std::iter::once(0.0)
            .chain(costs.layers.iter().scan(0.0, |sum, c| {
                *sum += c;
                Some(*sum)
            }))
            .collect();
        let stage_cost = |s: usize, from: usize, to: usize| {
            let mut cost = prefix[to] - prefix[from];
            if s == 0 {
                cost += costs.embedding;
            }
            if s == stages - 1 {
                cost += costs.head;
            }
            cost
        };
        // best[s][i]: the smallest possible maximum stage cost when stages 0..=s run layers 0..i;
        // cut[s][i]: where stage s starts in that optimum.
        let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
        let mut cut = vec![vec![0usize; n + 1]; stages];
        for (i, best) in best[0].iter_mut().enumerate().skip(1) {
            *best = stage_cost(0, 0, i);
        }
        for s in 1..stages {
            for i in s + 1..=n {
                for j in s..i {
                    let candidate = best[s - 1][j].max(stage_cost(s, j, i));
                    // `<` keeps the latest cut among equals: earlier stages longer.
                    if candidate < best[s][i] || (candidate == best[s][i] && j > cut[s][i]) {
                        best[s][i] = candidate;
                        cut[s][i] = j;
                    }
                }
            }
        }
        let mut ends = vec![n];
        for s in (1..stages).rev() {
            let end = *ends.last().expect("one end per stage");
            ends.push(cut[s][end]);
        }
        ends.push(0);
        ends.reverse();
        let layers = ends.windows(2).map(|w| w[0] as i64..w[1] as i64).collect();
        Ok(Partition { layers })
    }

    pub fn stages(&self) -> usize {
        self.layers.len()
    }
}

fn check(nlayers: i64, stages: usize) -> Result<()> {
    if stages == 0 {
        return usage("a pipeline needs at least one stage (--devices lists one device per stage)");
    }
    if stages as i64 > nlayers {
        return usage(format!(
            "{stages} pipeline stages but only {nlayers} encoder layers: every stage needs at least one layer \
             (use fewer --devices or more --nlayers)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_split_gives_earlier_stages_the_remainder() {
        assert_eq!(Partition::even(12, 2).unwrap().layers, [0..6, 6..12]);
        assert_eq!(Partition::even(5, 3).unwrap().layers, [0..2, 2..4, 4..5]);
        assert_eq!(Partition::even(3, 3).unwrap().layers, [0..1, 1..2, 2..3]);
        assert_eq!(Partition::even(4, 1).unwrap().layers, vec![0..4]);
    }

    #[test]
    fn more_stages_than_layers_is_a_usage_error() {
        let err = Partition::even(2, 3).unwrap_err();
        assert!(format!("{err}").contains("3 pipeline stages but only 2 encoder layers"), "{err}");
        assert_eq!(crate::error::exit_code(&err), 2);
        assert!(Partition::even(2, 0).is_err());
    }

    #[test]
    fn balancing_moves_layers_away_from_the_expensive_ends() {
        // Equal layers, cheap ends: the even split.
        let flat = LayerCosts { embedding: 0.0, layers: vec![1.0; 12], head: 0.0 };
        assert_eq!(Partition::balanced(&flat, 2).unwrap().layers, [0..6, 6..12]);
        // An output layer costing 4 layers: the last stage gives 2 layers to the first
        // (stage costs 8 and 4 + 4).
        let heavy_head = LayerCosts { head: 4.0, ..flat.clone() };
        assert_eq!(Partition::balanced(&heavy_head, 2).unwrap().layers, [0..8, 8..12]);
        // Three stages, heavy embedding: 2 + 2 layers, 4, and 4 + 0.
        let heavy_embedding = LayerCosts { embedding: 2.0, layers: vec![1.0; 10], head: 0.0 };
        let p = Partition::balanced(&heavy_embedding, 3).unwrap();
        assert_eq!(p.layers, [0..2, 2..6, 6..10]);
        // Every stage keeps at least one layer, whatever the costs.
        let lopsided = LayerCosts { embedding: 100.0, layers: vec![1.0; 3], head: 0.0 };
        assert_eq!(Partition::balanced(&lopsided, 3).unwrap().layers, [0..1, 1..2, 2..3]);
    }
}
