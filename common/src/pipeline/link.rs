//! How a device exchanges tensors with a neighbouring device: activations forward, gradients
//! backward. In one process, devices are threads joined by channels ([`ChannelLink`]); across
//! processes, point-to-point messages of the process group carry them.
//!
//! Every tensor travels tagged with the pass it feeds (an [`Op`]: direction, stage,
//! micro-batch), and the receiving device keeps in a [`Stash`] those that arrive before their
//! pass. With interleaving a device holds several stages, the last device feeds the first, and
//! with two devices one neighbour is both the previous and the next, so activations and
//! gradients of several stages share one stream of messages. The schedules here happen to need
//! every stream's tensors in the order they were sent (the schedule's tests check it for every
//! layout); the tags make the executor independent of that, and catch a mismatch.
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};

use anyhow::Result;
use tch::{Device, Tensor};

use super::Op;

/// One direction pair between two neighbouring devices.
pub trait Link {
    /// Hands `tensor`, tagged with the pass `tag` it feeds, to the neighbour; does not wait for
    /// it to be received.
    fn send(&mut self, tag: Op, tensor: &Tensor) -> Result<()>;
    /// The neighbour's next tensor (in the order it sent them) with its tag, on `device`.
    fn recv(&mut self, device: Device) -> Result<(Op, Tensor)>;
}

/// The tensors a device received before the passes they feed.
#[derive(Default)]
pub struct Stash(HashMap<Op, Tensor>);

impl Stash {
    /// The tensor for pass `pass`: kept already, or received from `link`, keeping the others
    /// that arrive first.
    pub fn take(&mut self, link: &mut dyn Link, pass: Op, device: Device) -> Result<Tensor> {
        if let Some(tensor) = self.0.remove(&pass) {
            return Ok(tensor);
        }
        loop {
            let (tag, tensor) = link.recv(device)?;
            if tag == pass {
                return Ok(tensor);
            }
            anyhow::ensure!(self.0.insert(tag, tensor).is_none(), "a neighbour sent the tensor for {tag:?} twice");
        }
    }

    /// Fails if a tensor was received that no pass took (the devices' schedules disagree).
    pub fn check_empty(&self) -> Result<()> {
        match self.0.keys().next() {
            None => Ok(()),
            Some(tag) => Err(anyhow::anyhow!("a neighbour sent a tensor for {tag:?}, which this device does not run")),
        }
    }
}

/// The neighbour stopped (its thread returned an error or panicked, or its process is gone):
/// a consequence, not a cause, so a pipeline reports the neighbour's own error instead.
#[derive(Debug)]
pub struct NeighbourGone;

impl std::fmt::Display for NeighbourGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a neighbouring pipeline stage stopped")
    }
}

impl std::error::Error for NeighbourGone {}

/// A link between two device threads of one process.
pub struct ChannelLink {
    tx: Sender<(Op, Tensor)>,
    rx: Receiver<(Op, Tensor)>,
}

impl ChannelLink {
    /// The two ends of a link: `(earlier device's end, later device's end)`. One thread may
    /// hold both (a device whose stages follow each other: one device, interleaved).
    pub fn pair() -> (ChannelLink, ChannelLink) {
        let (forward_tx, forward_rx) = channel();
        let (backward_tx, backward_rx) = channel();
        (ChannelLink { tx: forward_tx, rx: backward_rx }, ChannelLink { tx: backward_tx, rx: forward_rx })
    }
}

impl Link for ChannelLink {
    fn send(&mut self, tag: Op, tensor: &Tensor) -> Result<()> {
        // Same memory, no copy: nothing writes to an activation or a gradient once sent.
        self.tx.send((tag, tensor.detach())).map_err(|_| NeighbourGone.into())
    }

    fn recv(&mut self, device: Device) -> Result<(Op, Tensor)> {
        let (tag, tensor) = self.rx.recv().map_err(|_| NeighbourGone)?;
        Ok((tag, tensor.to_device(device)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_that_arrive_before_their_pass_wait_in_the_stash() {
        let (mut earlier, mut later) = ChannelLink::pair();
        let (first, second) = (Op::forward(1, 0), Op::backward(1, 3));
        earlier.send(first, &Tensor::from(1.0)).unwrap();
        earlier.send(second, &Tensor::from(2.0)).unwrap();
        let mut stash = Stash::default();
        // The later pass first: the earlier tensor is kept for its own pass.
        assert_eq!(stash.take(&mut later, second, Device::Cpu).unwrap().double_value(&[]), 2.0);
        assert!(stash.check_empty().is_err());
        assert_eq!(stash.take(&mut later, first, Device::Cpu).unwrap().double_value(&[]), 1.0);
        stash.check_empty().unwrap();
    }
}
