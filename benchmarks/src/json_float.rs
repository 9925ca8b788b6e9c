//! Floats in a result line that may not be finite. JSON has no NaN or infinity, and serde_json
//! writes them as `null`, which reads as "not measured" (and cannot enter the report's arithmetic)
//! exactly when a kernel is broken and the loss is NaN. These write such a float as the string
//! `"NaN"`, `"inf"` or `"-inf"` instead, which `benchmarks/gpu/report.py` reads back as the float
//! and flags.

use serde_json::Value;

/// `x` as a JSON number, or as the string `"NaN"`, `"inf"` or `"-inf"` when it is not finite.
pub fn float(x: f64) -> Value {
    if x.is_finite() {
        Value::from(x)
    } else if x.is_nan() {
        Value::from("NaN")
    } else if x > 0.0 {
        Value::from("inf")
    } else {
        Value::from("-inf")
    }
}

/// [`float`] of each of `xs`, as a JSON array.
pub fn floats(xs: &[f64]) -> Value {
    Value::Array(xs.iter().map(|&x| float(x)).collect())
}

/// [`float`] of a value that may not have been measured: `None` is `null`.
pub fn optional(x: Option<f64>) -> Value {
    x.map_or(Value::Null, float)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every non-finite float survives a round trip through JSON text as a string naming it
    /// (serde_json alone turns all three into `null`), and finite ones stay numbers.
    #[test]
    fn non_finite_floats_are_written_as_strings_naming_them() {
        let line = serde_json::json!({
            "loss": float(f64::NAN),
            "up": float(f64::INFINITY),
            "down": float(f64::NEG_INFINITY),
            "fine": float(2.5),
            "list": floats(&[1.0, f64::NAN]),
            "unmeasured": optional(None),
            "measured": optional(Some(f64::INFINITY)),
        });
        let text = line.to_string();
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["loss"], "NaN", "{text}");
        assert_eq!(back["up"], "inf");
        assert_eq!(back["down"], "-inf");
        assert_eq!(back["fine"].as_f64(), Some(2.5));
        assert_eq!(back["list"], serde_json::json!([1.0, "NaN"]));
        assert!(back["unmeasured"].is_null());
        assert_eq!(back["measured"], "inf");
        // What serde_json does on its own, which the report could not tell from "not measured".
        assert!(serde_json::json!(f64::NAN).is_null());
    }
}
