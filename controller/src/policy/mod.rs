//! Placement and routing policies: pure functions and state machines, no IO,
//! time passed in, so that they are tested on a virtual clock.

pub mod zipf;
