//! A rank's flat block of a model's parameters, as ZeRO shards them (`parallel::zero`): which
//! elements of which parameters it holds. An optimizer over such a block describes it with a
//! [`BlockLayout`] ([`super::Sharded::block_layout`]), and sharded checkpoints write and read
//! the block by that description, without the whole parameters or state ever being put
//! together. It lives here, below both the optimizers and the strategy that makes the blocks,
//! so that neither has to import the other for it.

/// The name a block's optimizer knows it by: its state entries are `<entry>.zero_block`.
pub const BLOCK_NAME: &str = "zero_block";

/// Part of a block: elements `[start, start + len)` of parameter `param` (flattened) sit at
/// `offset` in the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub param: usize,
    pub start: i64,
    pub len: i64,
    pub offset: i64,
}

/// Which elements of which parameters a rank's block holds: what a sharded checkpoint writes of
/// it and reads into it.
#[derive(Debug, Clone)]
pub struct BlockLayout {
    /// The parameters by their whole-model names, and their shapes on this rank.
    pub params: Vec<(String, Vec<i64>)>,
    pub spans: Vec<Span>,
    /// Elements of the block (its spans and the buckets' padding).
    pub len: i64,
}
