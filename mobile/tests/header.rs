//! `include/cohort.h` is what cbindgen generates from `src/ffi.rs` today.
//! With `COHORT_BLESS=1` the test rewrites the header instead.

#![allow(clippy::expect_used)]

use std::path::Path;

#[test]
fn the_c_header_is_up_to_date() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/ffi.rs"))
        .generate()
        .expect("cbindgen parses src/ffi.rs")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8 header");
    let path = root.join("include/cohort.h");
    if std::env::var_os("COHORT_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write the header");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/cohort.h is stale; regenerate it with COHORT_BLESS=1 cargo test -p cohort-mobile --test header"
    );
    for symbol in ["cohort_client_open", "cohort_client_participate", "COHORT_STATUS_PAUSED", "CohortTrainFn"]
    {
        assert!(generated.contains(symbol), "{symbol} missing from the header");
    }
}
