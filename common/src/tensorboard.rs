//! `--tensorboard DIR`: scalars in TensorBoard's event-file format, which TensorBoard (and
//! `torch.utils.tensorboard`'s readers) read directly.
//!
//! An event file is a sequence of TFRecords: a little-endian u64 length, its masked CRC32C, the
//! serialised `Event` protobuf, and its masked CRC32C. The first event names the file version
//! (`brain.Event:2`); each later one carries a `Summary` of `simple_value` scalars for a step.
//! The messages are the few fields of TensorFlow's `event.proto` and `summary.proto` that
//! scalars use, declared here with prost (a maintained protobuf crate); the Rust crates that
//! write TensorBoard files are unmaintained or pull in image and protobuf-compiler stacks.
//! `exercises/tests/tensorboard.rs` reads our files with TensorBoard's own `EventAccumulator`.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use prost::Message;

/// `tensorflow.Event` (the fields scalars need).
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a `simple_value`.
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// TFRecord's checksum: CRC32C, rotated and offset so that a CRC over data containing CRCs stays
/// informative.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Writes scalars to one event file in a log directory.
pub struct SummaryWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl SummaryWriter {
    /// A new event file `events.out.tfevents.<seconds>.<host>.<pid>` in `dir` (created if need be),
    /// starting with the file-version event.
    pub fn new(dir: &Path) -> Result<SummaryWriter> {
        // The run's own folder under --tensorboard: never a link someone planted there.
        crate::output::folder(dir).context("the TensorBoard run folder")?;
        let host = crate::comm::hosts::this_host();
        let seconds = now().floor() as u64;
        let path = dir.join(format!("events.out.tfevents.{seconds}.{host}.{}", std::process::id()));
        let file = crate::output::create_new(&path)?;
        let mut writer = SummaryWriter { path, out: BufWriter::new(file) };
        writer.write_event(&Event { wall_time: now(), step: 0, file_version: Some("brain.Event:2".into()), summary: None })?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records `value` under `tag` (e.g. `train/loss`) at `step`.
    pub fn add_scalar(&mut self, tag: &str, value: f64, step: usize) -> Result<()> {
        let summary = Summary { value: vec![SummaryValue { tag: tag.into(), simple_value: Some(value as f32) }] };
        self.write_event(&Event { wall_time: now(), step: step as i64, file_version: None, summary: Some(summary) })
    }

    /// Makes everything written so far visible to readers (call at epoch ends).
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }

    fn write_event(&mut self, event: &Event) -> Result<()> {
        let data = event.encode_to_vec();
        let length = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&length);
        record.extend_from_slice(&masked_crc(&length).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.out.write_all(&record).with_context(|| format!("cannot write {}", self.path.display()))
    }
}

impl Drop for SummaryWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_of_known_inputs() {
        // CRC32C("123456789") = 0xE3069283 (the standard check value); masking as TensorFlow's
        // `MaskedCrc`.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xE306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn records_are_framed_with_length_and_checksums() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = SummaryWriter::new(dir.path()).unwrap();
        writer.add_scalar("train/loss", 0.5, 7).unwrap();
        writer.flush().unwrap();
        let bytes = std::fs::read(writer.path()).unwrap();
        let mut events = Vec::new();
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let length = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            assert_eq!(u32::from_le_bytes(rest[8..12].try_into().unwrap()), masked_crc(&rest[..8]));
            let data = &rest[12..12 + length];
            assert_eq!(u32::from_le_bytes(rest[12 + length..16 + length].try_into().unwrap()), masked_crc(data));
            events.push(Event::decode(data).unwrap());
            rest = &rest[16 + length..];
        }
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        let value = &events[1].summary.as_ref().unwrap().value[0];
        assert_eq!((value.tag.as_str(), value.simple_value, events[1].step), ("train/loss", Some(0.5), 7));
    }
}
