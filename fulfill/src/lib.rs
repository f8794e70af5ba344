//! fort consumer side.
