//! fort handlers.
