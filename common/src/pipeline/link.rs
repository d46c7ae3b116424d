//! How a stage exchanges tensors with a neighbouring stage: activations forward, gradients
//! backward. In one process, stages are threads joined by channels ([`ChannelLink`]); across
//! processes, point-to-point messages of the process group carry them.
use std::sync::mpsc::{channel, Receiver, Sender};

use anyhow::Result;
use tch::{Device, Tensor};

/// One direction pair between two neighbouring stages.
pub trait Link {
    /// Hands `tensor` to the neighbour; does not wait for it to be received.
    fn send(&mut self, tensor: &Tensor) -> Result<()>;
    /// The neighbour's next tensor (in the order it sent them), on `device`.
    fn recv(&mut self, device: Device) -> Result<Tensor>;
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

/// A link between two stage threads of one process.
pub struct ChannelLink {
    tx: Sender<Tensor>,
    rx: Receiver<Tensor>,
}

impl ChannelLink {
    /// The two ends of a link: `(earlier stage's end, later stage's end)`.
    pub fn pair() -> (ChannelLink, ChannelLink) {
        let (forward_tx, forward_rx) = channel();
        let (backward_tx, backward_rx) = channel();
        (ChannelLink { tx: forward_tx, rx: backward_rx }, ChannelLink { tx: backward_tx, rx: forward_rx })
    }
}

impl Link for ChannelLink {
    fn send(&mut self, tensor: &Tensor) -> Result<()> {
        // Same memory, no copy: nothing writes to an activation or a gradient once sent.
        self.tx.send(tensor.detach()).map_err(|_| NeighbourGone.into())
    }

    fn recv(&mut self, device: Device) -> Result<Tensor> {
        let tensor = self.rx.recv().map_err(|_| NeighbourGone)?;
        Ok(tensor.to_device(device))
    }
}
