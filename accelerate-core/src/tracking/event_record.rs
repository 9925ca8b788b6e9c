//! TensorBoard's event file format: TFRecord framing around `Event` protobuf messages.
//!
//! A record is the data's length as a little-endian u64, the masked CRC-32C of those 8 bytes,
//! the data, and the masked CRC-32C of the data (TensorFlow's `record_writer.cc`). The messages
//! are the few fields of `tensorflow/core/util/event.proto` and `summary.proto` that scalars
//! use, declared with prost's derive (no protoc). Members of a proto `oneof` are encoded like
//! optional fields, so they are declared as such.

/// `tensorflow.Event`: a wall time, a step, and one of a file version or a summary.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The global step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// `"brain.Event:2"` in a file's first event (oneof `what`).
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    /// The values logged at this step (oneof `what`).
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
    /// A session's start (oneof `what`): readers drop the events of later steps logged before
    /// it, the orphans of a run that was resumed from an earlier checkpoint.
    #[prost(message, optional, tag = "6")]
    pub session_log: Option<SessionLog>,
}

/// `tensorflow.SessionLog`, its `status` alone.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct SessionLog {
    /// `SessionStatus`: 1 is `START` ([`SESSION_START`]).
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// `SessionLog.SessionStatus.START`.
pub(super) const SESSION_START: i32 = 1;

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct Summary {
    /// One value per tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with the `simple_value` member of its `value` oneof, which
/// TensorBoard's scalar dashboard reads (and PyTorch's `add_scalar` writes).
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct SummaryValue {
    /// The scalar's tag, e.g. `train/loss`.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// The value (TensorBoard stores scalars as f32).
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// The version string of the event format TensorBoard reads.
pub(super) const FILE_VERSION: &str = "brain.Event:2";

/// TFRecord's masked CRC-32C: rotated right by 15 bits plus a constant, so that a CRC stored
/// inside CRC'd data does not weaken the check.
pub(super) fn masked_crc32c(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord holding `data`.
pub(super) fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut record = Vec::with_capacity(data.len() + 16);
    record.extend_from_slice(&len);
    record.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    record.extend_from_slice(data);
    record.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    record
}

/// The records of a TFRecord file, each checked against both CRCs.
#[cfg(test)]
pub(super) fn unframe(mut bytes: &[u8]) -> crate::Result<Vec<Vec<u8>>> {
    use crate::error::Error;
    let corrupt = |what: &str| Error::Data(format!("TFRecord: {what}"));
    let mut records = Vec::new();
    while !bytes.is_empty() {
        if bytes.len() < 12 {
            return Err(corrupt("truncated length"));
        }
        let (len_bytes, rest) = bytes.split_at(8);
        let len_crc = u32::from_le_bytes(rest[..4].try_into().unwrap());
        if len_crc != masked_crc32c(len_bytes) {
            return Err(corrupt("length CRC mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let rest = &rest[4..];
        if rest.len() < len + 4 {
            return Err(corrupt("truncated data"));
        }
        let (data, rest) = rest.split_at(len);
        if u32::from_le_bytes(rest[..4].try_into().unwrap()) != masked_crc32c(data) {
            return Err(corrupt("data CRC mismatch"));
        }
        records.push(data.to_vec());
        bytes = &rest[4..];
    }
    Ok(records)
}

/// Encodes an event as one framed record.
pub(super) fn event_record(event: &Event) -> Vec<u8> {
    frame(&prost::Message::encode_to_vec(event))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_check_value_of_the_catalogue() {
        // CRC-32C (Castagnoli) of the ASCII digits "123456789": 0xE3069283 (the catalogue of
        // parametrised CRC algorithms, and RFC 3720's iSCSI polynomial).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // The mask by hand: rotr15(0xE3069283) = 0x2507C60D, + 0xA282EAD8 = 0xC78AB0E5.
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn a_frame_is_length_crc_data_crc_and_a_flipped_bit_is_caught() {
        let record = frame(b"abc");
        assert_eq!(&record[..8], &3u64.to_le_bytes());
        assert_eq!(&record[12..15], b"abc");
        assert_eq!(record.len(), 19);
        assert_eq!(unframe(&record).unwrap(), vec![b"abc".to_vec()]);
        let mut bad = record.clone();
        bad[13] ^= 1;
        assert!(unframe(&bad).is_err());
    }

    #[test]
    fn a_full_event_encodes_as_the_hand_encoded_bytes() {
        // wall_time 1.5 (field 1, fixed64: 0x09, then 1.5f64 = 0x3FF8000000000000 little-endian),
        // step 300 (field 2, varint: 0x10, 0xAC 0x02), summary (field 5, length-delimited: 0x2A)
        // holding one value (field 1: 0x0A) of tag "a" (0x0A 1 'a') and simple_value 2.0f32
        // (0x15, 0x40000000 little-endian).
        let scalar = Event {
            wall_time: 1.5,
            step: 300,
            file_version: None,
            summary: Some(Summary {
                value: vec![SummaryValue {
                    tag: "a".into(),
                    simple_value: Some(2.0),
                }],
            }),
            session_log: None,
        };
        let mut want = vec![0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, 0x10, 0xac, 0x02];
        want.extend_from_slice(&[0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15, 0, 0, 0, 0x40]);
        assert_eq!(prost::Message::encode_to_vec(&scalar), want);
        // step 3, session_log (field 6: 0x32) with status START (field 1, varint: 0x08 0x01).
        let start = Event {
            wall_time: 0.0,
            step: 3,
            file_version: None,
            summary: None,
            session_log: Some(SessionLog {
                status: SESSION_START,
            }),
        };
        assert_eq!(
            prost::Message::encode_to_vec(&start),
            vec![0x10, 3, 0x32, 2, 0x08, 1]
        );
    }

    #[test]
    fn events_encode_as_protobuf_field_by_field() {
        // Hand-encoded: field 2 (step, varint) = 5; field 3 (string) = "v".
        let event = Event {
            wall_time: 0.0,
            step: 5,
            file_version: Some("v".into()),
            summary: None,
            session_log: None,
        };
        assert_eq!(
            prost::Message::encode_to_vec(&event),
            vec![0x10, 5, 0x1a, 1, b'v']
        );
        // Field 1 (tag, string) "t"; field 2 (simple_value, fixed32) = 1.0f32 = 0x3F800000.
        let value = SummaryValue {
            tag: "t".into(),
            simple_value: Some(1.0),
        };
        assert_eq!(
            prost::Message::encode_to_vec(&value),
            vec![0x0a, 1, b't', 0x15, 0, 0, 0x80, 0x3f]
        );
    }
}
