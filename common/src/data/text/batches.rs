//! The language model's batch source: a split batchified into streams on the device, cut
//! into `bptt`-long windows in order, as the tutorial's training loop does.
use super::{batch_starts, batchify, get_batch};
use crate::train::{Batch, BatchSource};
use tch::{Device, Tensor};

pub struct TokenBatches {
    /// `[len / batch_size, batch_size]` token ids on the training device.
    data: Tensor,
    bptt: i64,
}

impl TokenBatches {
    /// Batchifies `tokens` (1-D ids) into `batch_size` streams and moves them to `device` once.
    pub fn new(tokens: &Tensor, batch_size: i64, bptt: i64, device: Device) -> Self {
        TokenBatches { data: batchify(tokens, batch_size).to_device(device), bptt }
    }

    /// Replica `index` of `count`'s share of the batches one process would make with
    /// `batch_size × count` streams: its `batch_size` consecutive streams of each. The replicas
    /// together train exactly the single process's batches (data parallelism that equals one
    /// process with the whole batch).
    pub fn sharded(tokens: &Tensor, batch_size: i64, bptt: i64, device: Device, (index, count): (usize, usize)) -> Self {
        let all = batchify(tokens, batch_size * count as i64);
        let mine = all.narrow(1, index as i64 * batch_size, batch_size).contiguous();
        TokenBatches { data: mine.to_device(device), bptt }
    }
}

impl BatchSource for TokenBatches {
    fn batches_per_epoch(&self) -> usize {
        batch_starts(&self.data, self.bptt).count()
    }

    /// The same windows every epoch: the tutorial does not shuffle a language-model corpus.
    fn epoch(&self, _epoch: usize) -> Box<dyn Iterator<Item = Batch> + '_> {
        Box::new(batch_starts(&self.data, self.bptt).map(|i| {
            let (inputs, targets) = get_batch(&self.data, i, self.bptt);
            Batch { inputs, targets }
        }))
    }
}
