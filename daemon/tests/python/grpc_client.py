"""A spillway.v1 client written against code that protoc and grpc's Python plugin generated from
our .proto file: nothing of ours but the protocol. Usage: grpc_client.py SOCKET GENERATED_DIR.
Prints one JSON object with what it saw; exits non-zero when the daemon misbehaves."""

import json
import sys

import grpc

socket_path, generated = sys.argv[1], sys.argv[2]
sys.path.insert(0, generated)
from spillway.v1 import spillway_pb2 as pb  # noqa: E402
from spillway.v1 import spillway_pb2_grpc as rpc  # noqa: E402

with grpc.insecure_channel("unix:" + socket_path) as channel:
    stub = rpc.SpillwayStub(channel)
    models = [m.name for m in stub.ListModels(pb.ListModelsRequest()).models]

    request = pb.GenerateRequest(
        tokens=pb.TokenIds(ids=[1, 2, 3]), max_tokens=5, ignore_eos=True, logprobs=True
    )
    messages = list(stub.Generate(request))
    last = messages[-1]
    assert last.finish_reason == pb.FINISH_REASON_MAX_TOKENS, last
    assert last.timings.generated_tokens == 5, last.timings
    assert all(m.HasField("logprob") for m in messages)

    try:
        list(stub.Generate(pb.GenerateRequest(max_tokens=5)))
        refused = None
    except grpc.RpcError as e:
        refused = e.code().name

    print(
        json.dumps(
            {
                "models": models,
                "tokens": [m.token for m in messages],
                "text": "".join(m.text for m in messages),
                "empty_request": refused,
            }
        )
    )
