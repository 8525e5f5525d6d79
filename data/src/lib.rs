//! Training data near the memory servers: what a dataset is, how its samples
//! are preprocessed, and labelled image sets generated for tests.
