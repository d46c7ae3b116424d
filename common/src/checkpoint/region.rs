//! Which elements of a whole-model tensor a piece of a sharded checkpoint holds: the whole
//! tensor, a tensor-parallel shard's cut of it, and within either a flat range (a ZeRO rank's
//! share of the flattened tensor). One description for what a rank writes and what a rank
//! wants to read, whatever the layout of either: reading is matching the two by the elements'
//! positions in the whole tensor (row-major), which every region lists in increasing order.
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::comm::tensor_parallel::{shard_tensor, Shard, Split};

/// Part of a whole tensor of shape `shape` (given beside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Region {
    /// The tensor-parallel cut the piece is (a part of); none: the whole tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<(Split, Shard)>,
    /// The elements `[start, start + len)` of the cut, flattened; none: all of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flat: Option<(i64, i64)>,
}

impl Region {
    pub const WHOLE: Region = Region { cut: None, flat: None };

    /// The part of a tensor cut as `split` that `shard` holds (the whole tensor when the shard
    /// is whole or the tensor is replicated).
    pub fn cut(split: Split, shard: Shard) -> Region {
        let cut = (split != Split::Replicated && !shard.is_whole()).then_some((split, shard));
        Region { cut, flat: None }
    }

    /// Elements `[start, start + len)` of this region, flattened.
    pub fn flat(self, start: i64, len: i64) -> Region {
        let flat = match self.flat {
            Some((outer, _)) => (outer + start, len),
            None => (start, len),
        };
        Region { flat: Some(flat), ..self }
    }

    /// The shape of the cut of a whole tensor of `shape` (before any flat range).
    pub fn cut_shape(self, shape: &[i64]) -> Vec<i64> {
        let mut cut = shape.to_vec();
        if let Some((split, shard)) = self.cut {
            cut[usize::from(split == Split::Columns)] /= shard.count as i64;
        }
        cut
    }

    /// The whole tensor's shape, from the shape of this region's cut (a shard's tensor).
    pub fn whole_shape(self, cut_shape: &[i64]) -> Vec<i64> {
        let mut whole = cut_shape.to_vec();
        if let Some((split, shard)) = self.cut {
            whole[usize::from(split == Split::Columns)] *= shard.count as i64;
        }
        whole
    }

    /// Why the region does not fit a whole tensor of `shape`, if it does not: a cut of a dimension
    /// the tensor lacks or that does not divide, a shard beyond its count, a flat range past the
    /// cut's end. (A region read from someone else's index is checked before it is used.)
    pub fn misfit(self, shape: &[i64]) -> Option<String> {
        if shape.iter().any(|&d| d < 0) {
            return Some(format!("a shape {shape:?} with a negative dimension"));
        }
        if let Some((split, shard)) = self.cut {
            if shard.count == 0 || shard.index >= shard.count {
                return Some(format!("shard {} of {}", shard.index, shard.count));
            }
            let count = shard.count as i64;
            let fits = match split {
                Split::Replicated => true,
                Split::Rows => !shape.is_empty() && shape[0] % count == 0,
                Split::Columns => shape.len() >= 2 && shape[1] % count == 0,
                Split::PackedRows(blocks) => blocks > 0 && !shape.is_empty() && shape[0] % blocks == 0 && (shape[0] / blocks) % count == 0,
            };
            if !fits {
                return Some(format!("a cut {split:?} into {count} of a {shape:?} tensor"));
            }
        }
        if let Some((start, len)) = self.flat {
            let cut: i64 = self.cut_shape(shape).iter().product();
            if start < 0 || len < 0 || start.checked_add(len).is_none_or(|end| end > cut) {
                return Some(format!("elements [{start}, {start} + {len}) of a cut of {cut}"));
            }
        }
        None
    }

    /// Elements the region holds of a whole tensor of `shape`.
    pub fn numel(self, shape: &[i64]) -> i64 {
        self.flat.map_or_else(|| self.cut_shape(shape).iter().product(), |(_, len)| len)
    }

    /// The shape a rank holding this region sees: the cut's, or a flat range's length.
    pub fn local_shape(self, shape: &[i64]) -> Vec<i64> {
        match self.flat {
            Some((_, len)) => vec![len],
            None => self.cut_shape(shape),
        }
    }

    /// `[first, end)` when the region's elements are consecutive in the whole tensor (the
    /// whole, a cut by rows, a flat range of either): read without listing them.
    pub fn contiguous(self, shape: &[i64]) -> Option<(i64, i64)> {
        let numel: i64 = shape.iter().product();
        let (start, len) = match self.cut {
            None => (0, numel),
            Some((Split::Rows | Split::PackedRows(1), shard)) => {
                let row: i64 = shape[1..].iter().product();
                let (first, rows) = shard.range(shape[0]);
                (first * row, rows * row)
            }
            Some(_) => return None,
        };
        Some(match self.flat {
            Some((at, len)) => (start + at, len),
            None => (start, len),
        })
    }

    /// The region's elements as runs of consecutive positions in the whole tensor (flattened,
    /// row-major), `(first, len)` in increasing order: a handful per cut (one per row of a
    /// column cut), whatever the tensor's size.
    pub fn runs(self, shape: &[i64]) -> Vec<(i64, i64)> {
        let numel: i64 = shape.iter().product();
        let cut: Vec<(i64, i64)> = match self.cut {
            None => vec![(0, numel)],
            Some((Split::Columns, shard)) => {
                let (cols, inner): (i64, i64) = (shape[1], shape[2..].iter().product());
                let (first, len) = shard.range(cols);
                (0..shape[0]).map(|r| ((r * cols + first) * inner, len * inner)).collect()
            }
            Some((split, shard)) => {
                let blocks = match split {
                    Split::PackedRows(n) => n,
                    _ => 1,
                };
                let (block_rows, row) = (shape[0] / blocks, shape[1..].iter().product::<i64>());
                let (first, len) = shard.range(block_rows);
                (0..blocks).map(|b| ((b * block_rows + first) * row, len * row)).collect()
            }
        };
        let Some((mut skip, mut take)) = self.flat else { return cut };
        let mut runs = Vec::new();
        for (first, len) in cut {
            if take == 0 {
                break;
            }
            if skip >= len {
                skip -= len;
                continue;
            }
            let n = (len - skip).min(take);
            runs.push((first + skip, n));
            (skip, take) = (0, take - n);
        }
        runs
    }

    /// The positions in the whole tensor (flattened, row-major) of the region's elements, in
    /// the order the region holds them: increasing. Built from the rows or columns the cut
    /// keeps (`shard_tensor`, the cut itself, applied to their numbers), never from the whole.
    pub fn positions(self, shape: &[i64]) -> Tensor {
        if let Some((first, len)) = self.contiguous(shape) {
            return Tensor::arange_start(first, first + len, (Kind::Int64, Device::Cpu));
        }
        let int = (Kind::Int64, Device::Cpu);
        let (split, shard) = self.cut.expect("a region that is not contiguous is a cut");
        let rows = shape[0];
        let row: i64 = shape[1..].iter().product();
        let all = match split {
            Split::Columns => {
                let cols = shape[1];
                let inner: i64 = shape[2..].iter().product();
                let kept = shard_tensor(&Tensor::arange(cols, int).unsqueeze(0), split, shard).squeeze_dim(0);
                // Row r, kept column c, inner element i: (r · cols + c) · inner + i.
                let at = (Tensor::arange(rows, int) * cols).unsqueeze(1) + kept.unsqueeze(0);
                ((at * inner).unsqueeze(2) + Tensor::arange(inner, int).view([1, 1, inner])).reshape([-1])
            }
            _ => {
                let kept = shard_tensor(&Tensor::arange(rows, int).unsqueeze(1), split, shard).squeeze_dim(1);
                ((kept * row).unsqueeze(1) + Tensor::arange(row, int).unsqueeze(0)).reshape([-1])
            }
        };
        match self.flat {
            Some((start, len)) => all.narrow(0, start, len),
            None => all,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_that_does_not_fit_its_tensor_says_why() {
        let shape = [8, 6];
        assert_eq!(Region::WHOLE.misfit(&shape), None);
        assert_eq!(Region::cut(Split::Columns, Shard { index: 1, count: 2 }).flat(3, 21).misfit(&shape), None);
        for (region, why) in [
            (Region::WHOLE.flat(40, 9), "elements [40, 40 + 9) of a cut of 48"),
            (Region::WHOLE.flat(-1, 2), "elements [-1"),
            (Region { cut: Some((Split::Rows, Shard { index: 3, count: 2 })), flat: None }, "shard 3 of 2"),
            (Region { cut: Some((Split::Rows, Shard { index: 0, count: 0 })), flat: None }, "shard 0 of 0"),
            (Region { cut: Some((Split::Columns, Shard { index: 0, count: 4 })), flat: None }, "a cut Columns into 4"),
            (Region { cut: Some((Split::PackedRows(3), Shard { index: 0, count: 2 })), flat: None }, "a cut PackedRows(3) into 2"),
        ] {
            let said = region.misfit(&shape).unwrap_or_default();
            assert!(said.contains(why), "{region:?}: {said}");
        }
        assert!(Region::cut(Split::Columns, Shard { index: 0, count: 2 }).misfit(&[8]).is_some(), "a vector has no columns");
    }

    /// The elements `region` holds of `whole`, cut as the layouts cut tensors.
    fn held(whole: &Tensor, region: Region) -> Tensor {
        let cut = match region.cut {
            Some((split, shard)) => shard_tensor(whole, split, shard),
            None => whole.copy(),
        };
        let flat = cut.reshape([-1]);
        match region.flat {
            Some((start, len)) => flat.narrow(0, start, len),
            None => flat,
        }
    }

    #[test]
    fn positions_name_exactly_the_elements_each_cut_and_range_holds_in_increasing_order() {
        let shape = [12i64, 6];
        let whole = Tensor::arange(72, (Kind::Int64, Device::Cpu)).view(shape);
        let mut regions = vec![Region::WHOLE, Region::WHOLE.flat(5, 30)];
        for split in [Split::Rows, Split::Columns, Split::PackedRows(3), Split::Replicated] {
            for index in 0..2 {
                let region = Region::cut(split, Shard { index, count: 2 });
                regions.push(region);
                regions.push(region.flat(7, 20).flat(3, 10));
            }
        }
        for region in regions {
            let positions = region.positions(&shape);
            let expected = held(&whole, region);
            assert_eq!(positions, expected, "{region:?}");
            assert_eq!(positions.size(), [region.numel(&shape)], "{region:?}");
            let steps = positions.diff(1, 0, None::<Tensor>, None::<Tensor>);
            assert!(steps.numel() == 0 || steps.min().int64_value(&[]) > 0, "{region:?}: increasing");
            let from_runs: Vec<i64> = region.runs(&shape).into_iter().flat_map(|(first, len)| first..first + len).collect();
            assert_eq!(Vec::<i64>::try_from(&positions).unwrap(), from_runs, "{region:?}: runs");
            if let Some((first, len)) = region.contiguous(&shape) {
                assert_eq!(positions, Tensor::arange_start(first, first + len, (Kind::Int64, Device::Cpu)), "{region:?}");
            }
        }
        assert_eq!(Region::cut(Split::PackedRows(3), Shard { index: 1, count: 2 }).contiguous(&shape), None);
        assert_eq!(Region::cut(Split::Rows, Shard { index: 1, count: 2 }).contiguous(&shape), Some((36, 36)));
    }

    #[test]
    fn a_cut_of_a_three_dimensional_tensor_keeps_whole_inner_rows() {
        let shape = [4i64, 6, 2];
        let whole = Tensor::arange(48, (Kind::Int64, Device::Cpu)).view(shape);
        for split in [Split::Rows, Split::Columns] {
            let region = Region::cut(split, Shard { index: 1, count: 2 });
            assert_eq!(region.positions(&shape), held(&whole, region), "{split:?}");
            assert_eq!(region.cut_shape(&shape), shard_tensor(&whole, split, Shard { index: 1, count: 2 }).size());
            assert_eq!(region.whole_shape(&region.cut_shape(&shape)), shape);
        }
    }
}
