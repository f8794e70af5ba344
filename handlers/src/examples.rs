pub const EXAMPLES: &[(&str, &str)] = &[];
