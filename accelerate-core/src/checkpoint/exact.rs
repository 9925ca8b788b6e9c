//! Floats in JSON that come back bit for bit: serde_json's default parser may round the last digit,
//! and a resumed run must use exactly the saved learning rate and step scales.

use serde::{Deserialize, Serialize};

/// An `f64` stored as its readable value (for people) and its bit pattern (what is loaded).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ExactF64 {
    value: f64,
    bits: String,
}

impl ExactF64 {
    pub fn new(v: f64) -> Self {
        Self {
            value: v,
            bits: format!("{:016x}", v.to_bits()),
        }
    }

    /// The exact value, or a description of what is wrong with the stored bits.
    pub fn get(&self) -> std::result::Result<f64, String> {
        let bits = u64::from_str_radix(&self.bits, 16)
            .map_err(|_| format!("{:?} is not 16 hexadecimal digits", self.bits))?;
        let v = f64::from_bits(bits);
        // The readable value must describe the same number (a hand edit of one but not the other).
        let agrees = v == self.value
            || (v.is_nan() && self.value.is_nan())
            || (v - self.value).abs() <= 1e-12 * v.abs().max(1e-300);
        if !agrees {
            return Err(format!(
                "value {} and bits {} disagree (edited by hand?)",
                self.value, self.bits
            ));
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_that_json_rounds_come_back_exactly() {
        for v in [
            0.1,
            1e-3,
            0.9990000000000001,
            f64::MIN_POSITIVE,
            123456.789e-7,
        ] {
            let json = serde_json::to_string(&ExactF64::new(v)).unwrap();
            let back: ExactF64 = serde_json::from_str(&json).unwrap();
            assert_eq!(back.get().unwrap().to_bits(), v.to_bits());
        }
        let forged: ExactF64 =
            serde_json::from_str(r#"{"value":0.5,"bits":"3ff0000000000000"}"#).unwrap();
        assert!(forged.get().unwrap_err().contains("disagree"));
    }
}
