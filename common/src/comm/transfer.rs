//! Tensors of any shape between two ranks, point-to-point: each travels as a small header (kind
//! and shape, so the receiver can allocate it) followed by its data. A pipeline's activations
//! (the last batch of a split is shorter) and the pieces of a checkpoint gathered from the
//! ranks that hold them use it; lists of named tensors travel as their names, then each tensor.
use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::ProcessGroup;

/// Up to this many dimensions travel in a header.
const MAX_DIMS: usize = 6;
/// Kinds a tensor may have, by their index in the header.
const KINDS: [Kind; 7] = [Kind::Float, Kind::Half, Kind::BFloat16, Kind::Double, Kind::Int64, Kind::Int, Kind::Uint8];
/// The integers a message carries beside its tensor: what the receiver needs to know of it
/// (a pipeline's tag: which pass the tensor feeds).
pub type Label = [i64; 3];
/// Header words: kind, number of dimensions, the label, the dimensions.
const HEADER: usize = 2 + 3 + MAX_DIMS;

/// Hands `tensor` to rank `dst` of `group` (without waiting for it to be received).
pub fn send_tensor(group: &ProcessGroup, tensor: &Tensor, dst: usize) -> Result<()> {
    send_labelled(group, tensor, [0; 3], dst)
}

/// [`send_tensor`] with `label` in the header.
pub fn send_labelled(group: &ProcessGroup, tensor: &Tensor, label: Label, dst: usize) -> Result<()> {
    let dims = tensor.size();
    let kind = KINDS.iter().position(|&k| k == tensor.kind());
    let (Some(kind), true) = (kind, dims.len() <= MAX_DIMS) else {
        bail!("cannot send a {:?} tensor of shape {dims:?} to rank {dst}", tensor.kind());
    };
    let mut header = vec![kind as i64, dims.len() as i64];
    header.extend(label);
    header.extend(&dims);
    header.resize(HEADER, 0);
    let header = Tensor::from_slice(&header).to_device(tensor.device());
    group.send(&header, dst)?;
    group.send(&tensor.detach().contiguous(), dst)
}

/// The next tensor rank `src` sent with [`send_tensor`], on `device` (of the sender's device type).
pub fn recv_tensor(group: &ProcessGroup, src: usize, device: Device) -> Result<Tensor> {
    Ok(recv_labelled(group, src, device)?.1)
}

/// The next tensor rank `src` sent with [`send_labelled`] (or [`send_tensor`]), with its label.
pub fn recv_labelled(group: &ProcessGroup, src: usize, device: Device) -> Result<(Label, Tensor)> {
    let mut header = Tensor::zeros([HEADER as i64], (Kind::Int64, device));
    group.recv(&mut header, src)?;
    let header = Vec::<i64>::try_from(header.to_device(Device::Cpu))?;
    let kind = *KINDS.get(header[0] as usize).context("a message header names an unknown kind")?;
    let label = [header[2], header[3], header[4]];
    let dims = &header[5..5 + (header[1] as usize).min(MAX_DIMS)];
    let mut tensor = Tensor::empty(dims, (kind, device));
    group.recv(&mut tensor, src)?;
    Ok((label, tensor))
}

/// Sends `tensors` with their names to rank `dst` (CPU copies: through the CPU engine).
pub fn send_named(group: &ProcessGroup, tensors: &[(String, Tensor)], dst: usize) -> Result<()> {
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    let names = serde_json::to_vec(&names)?;
    send_tensor(group, &Tensor::from_slice(&names), dst)?;
    for (_, tensor) in tensors {
        send_tensor(group, &tensor.to_device(Device::Cpu), dst)?;
    }
    group.wait_sends()
}

/// What rank `src` sent with [`send_named`], on the CPU.
pub fn recv_named(group: &ProcessGroup, src: usize) -> Result<Vec<(String, Tensor)>> {
    let names = recv_tensor(group, src, Device::Cpu)?;
    let names: Vec<String> = serde_json::from_slice(&Vec::<u8>::try_from(&names)?).context("an unreadable list of tensor names")?;
    names.into_iter().map(|name| Ok((name, recv_tensor(group, src, Device::Cpu)?))).collect()
}
