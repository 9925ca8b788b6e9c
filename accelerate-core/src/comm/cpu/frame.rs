//! Frames on the ring connections between ranks.
//!
//! Every frame starts with a fixed 24-byte header, validated before any payload is read:
//!
//! | bytes  | field                                                                   |
//! |--------|-------------------------------------------------------------------------|
//! | 0      | kind: data, keep-alive or abort                                         |
//! | 1      | collective code ([`OpCode`]), so ranks running different collectives are caught |
//! | 2      | element type code                                                       |
//! | 3      | reserved, 0                                                             |
//! | 4..8   | data: index of the frame within the collective; abort: the failed rank  |
//! | 8..16  | sequence number of the collective on this communicator                  |
//! | 16..24 | payload length in bytes                                                 |
//!
//! All integers are little-endian. An abort frame's payload is the reporting rank (`u64`) followed
//! by the reason as UTF-8 text, [`MAX_ABORT_BYTES`] in all at most.

use crate::comm::ReduceOp;

/// Size of a frame header.
pub(crate) const HEADER_BYTES: usize = 24;

/// Largest payload of an abort frame (the reason text).
pub(crate) const MAX_ABORT_BYTES: usize = 4096;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameKind {
    /// A chunk of tensor data.
    Data,
    /// Nothing: the sender is alive and inside the collective, waiting for its own input.
    KeepAlive,
    /// The collective failed; the payload says which rank and why.
    Abort,
}

impl FrameKind {
    fn code(self) -> u8 {
        match self {
            FrameKind::Data => 1,
            FrameKind::KeepAlive => 2,
            FrameKind::Abort => 3,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(FrameKind::Data),
            2 => Some(FrameKind::KeepAlive),
            3 => Some(FrameKind::Abort),
            _ => None,
        }
    }
}

/// Which collective a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpCode {
    /// `all_reduce` with the given operation.
    AllReduce(ReduceOp),
    /// `broadcast`.
    Broadcast,
    /// `all_gather`.
    AllGather,
    /// `barrier`.
    Barrier,
    /// `reduce_scatter` with the given operation.
    ReduceScatter(ReduceOp),
    /// `all_gather_into`.
    AllGatherInto,
}

impl OpCode {
    pub(crate) fn code(self) -> u8 {
        match self {
            OpCode::AllReduce(ReduceOp::Sum) => 1,
            OpCode::AllReduce(ReduceOp::Mean) => 2,
            OpCode::AllReduce(ReduceOp::Max) => 3,
            OpCode::Broadcast => 4,
            OpCode::AllGather => 5,
            OpCode::Barrier => 6,
            OpCode::ReduceScatter(ReduceOp::Sum) => 7,
            OpCode::ReduceScatter(ReduceOp::Mean) => 8,
            OpCode::ReduceScatter(ReduceOp::Max) => 9,
            OpCode::AllGatherInto => 10,
        }
    }

    /// The collective's name, as users call it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpCode::AllReduce(_) => "all_reduce",
            OpCode::Broadcast => "broadcast",
            OpCode::AllGather => "all_gather",
            OpCode::Barrier => "barrier",
            OpCode::ReduceScatter(_) => "reduce_scatter",
            OpCode::AllGatherInto => "all_gather_into",
        }
    }

    /// Describes a code received from a peer, for mismatch errors.
    pub(crate) fn describe(code: u8) -> String {
        match code {
            1 => "all_reduce(Sum)".into(),
            2 => "all_reduce(Mean)".into(),
            3 => "all_reduce(Max)".into(),
            4 => "broadcast".into(),
            5 => "all_gather".into(),
            6 => "barrier".into(),
            7 => "reduce_scatter(Sum)".into(),
            8 => "reduce_scatter(Mean)".into(),
            9 => "reduce_scatter(Max)".into(),
            10 => "all_gather_into".into(),
            other => format!("unknown collective {other}"),
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    /// What the frame carries.
    pub kind: FrameKind,
    /// [`OpCode::code`] of the collective.
    pub op: u8,
    /// Element type code.
    pub dtype: u8,
    /// Data: frame index within the collective; abort: the failed rank.
    pub index: u32,
    /// Collective sequence number.
    pub seq: u64,
    /// Payload bytes following the header.
    pub len: u64,
}

impl Header {
    /// Writes the header into the first [`HEADER_BYTES`] of `out`.
    pub(crate) fn write(&self, out: &mut [u8]) {
        out[0] = self.kind.code();
        out[1] = self.op;
        out[2] = self.dtype;
        out[3] = 0;
        out[4..8].copy_from_slice(&self.index.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.len.to_le_bytes());
    }

    /// Parses a header; `Err` describes what is malformed.
    pub(crate) fn parse(bytes: &[u8; HEADER_BYTES]) -> Result<Self, String> {
        let kind = FrameKind::from_code(bytes[0])
            .ok_or_else(|| format!("unknown frame kind {}", bytes[0]))?;
        if bytes[3] != 0 {
            return Err(format!("reserved header byte is {}", bytes[3]));
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        Ok(Header {
            kind,
            op: bytes[1],
            dtype: bytes[2],
            index: u32_at(4),
            seq: u64_at(8),
            len: u64_at(16),
        })
    }
}

/// Makes an abort frame's payload: the reporting rank, then as much of `reason` as fits.
pub(crate) fn encode_abort(reporter: u64, reason: &str) -> Vec<u8> {
    let text = reason.as_bytes();
    let mut payload = reporter.to_le_bytes().to_vec();
    payload.extend_from_slice(&text[..text.len().min(MAX_ABORT_BYTES - 8)]);
    payload
}

/// Parses an abort frame's payload into the reporting rank and the reason. The reason may have
/// been cut inside a character by [`encode_abort`]; it is decoded leniently, since it is only shown.
pub(crate) fn parse_abort(payload: &[u8]) -> Result<(u64, String), String> {
    if payload.len() < 8 || payload.len() > MAX_ABORT_BYTES {
        return Err(format!(
            "abort frame with a payload of {} bytes (8 to {MAX_ABORT_BYTES} expected)",
            payload.len()
        ));
    }
    let reporter = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
    Ok((
        reporter,
        String::from_utf8_lossy(&payload[8..]).into_owned(),
    ))
}

/// Checks that an abort frame names ranks of this job: the failed rank (from the header) and the
/// reporting rank (from the payload) must both be below `world_size`, or the frame came from a
/// peer of another job or version and its culprit would be a rank that does not exist.
pub(crate) fn check_abort_ranks(
    failed: u64,
    reporter: u64,
    world_size: usize,
) -> Result<(), String> {
    for (role, rank) in [("failed", failed), ("reporting", reporter)] {
        if rank >= world_size as u64 {
            return Err(format!(
                "abort frame names {role} rank {rank} in a job of {world_size} ranks"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abort_payloads_round_trip_and_are_bounded() {
        let payload = encode_abort(3, "rank 2 closed its connection");
        assert_eq!(payload[..8], 3u64.to_le_bytes());
        assert_eq!(
            parse_abort(&payload).unwrap(),
            (3, "rank 2 closed its connection".to_string())
        );
        // A reason longer than the frame allows is cut to fit, and still parses.
        let long = "x".repeat(2 * MAX_ABORT_BYTES);
        let payload = encode_abort(0, &long);
        assert_eq!(payload.len(), MAX_ABORT_BYTES);
        assert_eq!(parse_abort(&payload).unwrap().1.len(), MAX_ABORT_BYTES - 8);
        assert!(parse_abort(&payload[..7]).is_err());
        assert!(parse_abort(&vec![0; MAX_ABORT_BYTES + 1]).is_err());
    }

    #[test]
    fn abort_frames_must_name_ranks_of_the_job() {
        assert!(check_abort_ranks(3, 0, 4).is_ok());
        let failed = check_abort_ranks(4, 0, 4).unwrap_err();
        assert!(
            failed.contains("failed rank 4") && failed.contains("4 ranks"),
            "{failed}"
        );
        let reporter = check_abort_ranks(1, 9, 4).unwrap_err();
        assert!(reporter.contains("reporting rank 9"), "{reporter}");
        assert!(check_abort_ranks(u64::MAX, 0, 2).is_err());
    }

    #[test]
    fn headers_round_trip_and_have_the_documented_layout() {
        let header = Header {
            kind: FrameKind::Data,
            op: OpCode::AllGather.code(),
            dtype: 3,
            index: 0x0102_0304,
            seq: 9,
            len: 4096,
        };
        let mut bytes = [0u8; HEADER_BYTES];
        header.write(&mut bytes);
        assert_eq!(bytes[..4], [1, 5, 3, 0]);
        assert_eq!(bytes[4..8], [4, 3, 2, 1]);
        assert_eq!(bytes[8], 9);
        assert_eq!(bytes[16..18], [0, 16]);
        assert_eq!(Header::parse(&bytes).unwrap(), header);
        bytes[0] = 9;
        assert!(Header::parse(&bytes).is_err());
    }
}
