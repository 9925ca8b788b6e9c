//! accelerate-text's integration tests: corpora against the fixtures' sidecar (written by
//! pyarrow and `datasets`), packing against a naive reference, token files against their byte
//! layout, and the datasets through accelerate-core's loaders.

mod common;
mod corpus;
mod packed;
mod pretokenize;
mod split;
mod streamed;
mod token_file;
