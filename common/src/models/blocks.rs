//! A model's blocks: its variables grouped into the units a forward pass runs one after the
//! other, the head last. Transfer learning speaks in them: `--train-last N` trains the last N
//! blocks, `--freeze backbone` the last one alone, and the head is what a pretrained file of
//! another class count does not fill ([`super::load_weights`]).
//!
//! | model | blocks, in order | count |
//! |---|---|---|
//! | ResNet34 | the stem (`conv1`, `bn1`), the 16 BasicBlocks (`layer1.0` .. `layer4.2`), `fc` | 18 |
//! | ResNet50 | the stem (`conv1`, `bn1`), the 16 Bottlenecks (`layer1.0` .. `layer4.2`), `fc` | 18 |
//! | ResNet50V2 | the stem (`conv1_conv`), the 16 pre-activation blocks (`conv2_block1` .. `conv5_block3`, the last with `post_bn`), `predictions` | 18 |
//! | VGG19 | the 16 convolutions (`features.0` .. `features.34`), `classifier.0`, `.3`, `.6` | 19 |
//! | CNN | `conv1`, `conv2`, `fc1`, `fc2` | 4 |
//!
//! ResNet's unit is the residual block (BasicBlock or Bottleneck) rather than the stage (`layer1` .. `layer4`): it is the
//! residual unit the network is built from, and it still says "the last stage and the head"
//! (`--train-last 4`: `layer4`'s 3 blocks and `fc`), while also allowing less. VGG19's blocks
//! are its 19 weight layers, the ones its name counts.
/// One block: the variables under its name prefixes (`layer2.0` holds `layer2.0.conv1.weight`,
/// `layer2.0.downsample.1.running_mean`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// What the block is called in messages: its prefix, or the stem's own name.
    pub name: String,
    prefixes: Vec<String>,
}

impl Block {
    /// A block holding the variables under `prefixes` (module paths in torchvision's names).
    pub(super) fn new(name: impl Into<String>, prefixes: &[&str]) -> Block {
        Block { name: name.into(), prefixes: prefixes.iter().map(|p| p.to_string()).collect() }
    }

    /// The block of one module path, named by it.
    pub(super) fn module(path: impl Into<String>) -> Block {
        let path = path.into();
        Block { name: path.clone(), prefixes: vec![path] }
    }

    /// Whether the variable `name` (`layer2.0.conv1.weight`) belongs to this block.
    pub fn holds(&self, name: &str) -> bool {
        self.prefixes.iter().any(|prefix| name.strip_prefix(prefix.as_str()).is_some_and(|rest| rest.starts_with('.')))
    }
}

/// The blocks of a model in forward order; the last is the head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocks(Vec<Block>);

impl Blocks {
    /// The blocks in forward order, the head last (each architecture's module lists its own;
    /// [`Blocks::of`] picks the model's).
    pub(super) fn new(blocks: Vec<Block>) -> Blocks {
        Blocks(blocks)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Block> {
        self.0.iter()
    }

    /// The classifier's last layer, which maps the features to the classes.
    pub fn head(&self) -> &Block {
        self.0.last().expect("a model has blocks")
    }

    /// The position of the block holding the variable `name`, if any.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.0.iter().position(|block| block.holds(name))
    }
}
