//! Which of a model's layers Accelerate's FSDP config wraps: the examples declare their units by
//! their block class (`GPT2Block`, `LlamaDecoderLayer`), and a config that names another class
//! is refused rather than silently sharded some other way.

use anyhow::{bail, Result};

/// Checks `ACCELERATE_FSDP_LAYER_CLASSES` (set by `accelerate-launch` from
/// `fsdp_transformer_layer_cls_to_wrap`) against the model's block class `block_class`: unset,
/// or naming it, is fine; naming only other classes is an error naming both.
pub fn check_wrap_classes(block_class: &str) -> Result<()> {
    let name = accelerate_core::env::FSDP_LAYER_CLASSES;
    let Ok(value) = std::env::var(name) else {
        return Ok(());
    };
    if value.split(',').any(|c| c.trim() == block_class) {
        return Ok(());
    }
    bail!(
        "{name}={value:?} (fsdp_transformer_layer_cls_to_wrap) names no layer class of this \
         model: its transformer blocks are {block_class}, and each is one sharded unit; set \
         fsdp_transformer_layer_cls_to_wrap: {block_class}"
    )
}
