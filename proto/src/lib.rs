//! The `spillway.v1` gRPC protocol: the protobuf definitions in `proto/` and the tonic/prost code
//! generated from them at build time, and where the daemon listens by default ([`endpoint`]).

pub mod endpoint;

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("spillway.v1");

    /// Encoded file descriptors, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("spillway_descriptor");
}

#[cfg(test)]
mod tests {
    use super::v1::*;
    use prost::Message;

    #[test]
    fn generate_request_round_trips_through_the_wire_format() {
        let req = GenerateRequest {
            model: "tiny".into(),
            input: Some(generate_request::Input::Tokens(TokenIds {
                ids: vec![1, 2, 3],
            })),
            max_tokens: 16,
            stop: vec!["\n\n".into()],
            ..Default::default()
        };
        let bytes = req.encode_to_vec();
        assert_eq!(GenerateRequest::decode(&bytes[..]).unwrap(), req);
    }

    #[test]
    fn descriptor_set_names_the_service() {
        let set = prost_types_free_check(FILE_DESCRIPTOR_SET);
        assert!(set, "descriptor set mentions spillway.v1.Spillway");
    }

    /// The descriptor set is protobuf bytes; the service's full name appears in it verbatim.
    fn prost_types_free_check(bytes: &[u8]) -> bool {
        bytes.windows(b"Spillway".len()).any(|w| w == b"Spillway")
            && bytes
                .windows(b"spillway.v1".len())
                .any(|w| w == b"spillway.v1")
    }
}
