//! The language model's batch source: a split batchified into streams on the device, cut
//! into `bptt`-long windows in order, as the tutorial's training loop does.
use super::{batch_starts, batchify, get_batch};
use crate::train::{Batch, BatchSource, Batches};
use tch::{Device, Tensor};

pub struct TokenBatches {
    /// `[len / batch_size, batch_size]` token ids on the training device.
    data: Tensor,
    bptt: i64,
    /// Windows side by side in one batch (evaluation: see [`TokenBatches::grouped`]).
    group: usize,
}

impl TokenBatches {
    /// Batchifies `tokens` (1-D ids) into `batch_size` streams and moves them to `device` once.
    pub fn new(tokens: &Tensor, batch_size: i64, bptt: i64, device: Device) -> Self {
        TokenBatches { data: batchify(tokens, batch_size).to_device(device), bptt, group: 1 }
    }

    /// Replica `index` of `count`'s share of the batches one process would make with
    /// `batch_size × count` streams: its `batch_size` consecutive streams of each. The replicas
    /// together train exactly the single process's batches (data parallelism that equals one
    /// process with the whole batch).
    pub fn sharded(tokens: &Tensor, batch_size: i64, bptt: i64, device: Device, (index, count): (usize, usize)) -> Self {
        let all = batchify(tokens, batch_size * count as i64);
        let mine = all.narrow(1, index as i64 * batch_size, batch_size).contiguous();
        TokenBatches { data: mine.to_device(device), bptt, group: 1 }
    }

    /// The same windows, `group` of them side by side in each batch (`[bptt, batch × group]`;
    /// the shorter last window alone): what evaluation runs, since every window is evaluated
    /// on its own anyway (each column is one stream's window, its own causal context), so the
    /// losses are the same, in a few large passes instead of many small ones.
    pub fn grouped(mut self, group: usize) -> Self {
        self.group = group.max(1);
        self
    }
}

impl TokenBatches {
    /// The window starts in groups of `self.group` full windows; a shorter last window alone.
    fn chunks<'a>(&self, starts: &'a [i64]) -> impl Iterator<Item = &'a [i64]> + 'a {
        let rows = self.data.size()[0];
        let full = starts.iter().take_while(|&&i| i + self.bptt < rows).count();
        let (full, short) = starts.split_at(full);
        full.chunks(self.group).chain(short.chunks(1))
    }
}

impl BatchSource for TokenBatches {
    fn batches_per_epoch(&self) -> usize {
        let starts: Vec<i64> = batch_starts(&self.data, self.bptt).collect();
        self.chunks(&starts).count()
    }

    /// The same windows every epoch: the tutorial does not shuffle a language-model corpus.
    fn epoch(&self, _epoch: usize) -> Batches<'_> {
        let starts: Vec<i64> = batch_starts(&self.data, self.bptt).collect();
        let batches: Vec<Batch> = self
            .chunks(&starts)
            .map(|group| {
                let windows: Vec<(Tensor, Tensor)> = group.iter().map(|&i| get_batch(&self.data, i, self.bptt)).collect();
                if let [(inputs, targets)] = &windows[..] {
                    return Batch { inputs: inputs.shallow_clone(), targets: targets.shallow_clone() };
                }
                // Side by side: inputs along the batch dimension, targets likewise (they are
                // each window's `[seq, batch]` flattened).
                let seq = windows[0].0.size()[0];
                let inputs: Vec<Tensor> = windows.iter().map(|(x, _)| x.shallow_clone()).collect();
                let targets: Vec<Tensor> = windows.iter().map(|(_, y)| y.view([seq, -1])).collect();
                Batch { inputs: Tensor::cat(&inputs, 1), targets: Tensor::cat(&targets, 1).reshape([-1]) }
            })
            .collect();
        Box::new(batches.into_iter().map(Ok))
    }
}
