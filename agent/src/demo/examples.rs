//! The example capability handlers from `handlers/examples/`, compiled in so the single
//! `fort-agent` binary can write them out (the demo does). Each is a short POSIX sh script
//! (needing `jq`, and `openssl` for certificates) meant to be copied and adapted.

/// `(file name, script text)` of every example handler.
pub const EXAMPLES: &[(&str, &str)] = &[
    (
        "oidc-provider.sh",
        include_str!("../../../handlers/examples/oidc-provider.sh"),
    ),
    (
        "cert-provider.sh",
        include_str!("../../../handlers/examples/cert-provider.sh"),
    ),
    (
        "proxy-provider.sh",
        include_str!("../../../handlers/examples/proxy-provider.sh"),
    ),
    (
        "store-payload.sh",
        include_str!("../../../handlers/examples/store-payload.sh"),
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_example_is_a_commented_sh_script() {
        assert_eq!(EXAMPLES.len(), 4);
        for (name, text) in EXAMPLES {
            assert!(text.starts_with("#!/bin/sh\n# "), "{name}");
            assert!(text.contains("NixOS"), "{name} says how to use it");
        }
    }
}
