"""A gRPC proxy that injects failures between a client and a tally server.

Forwards every unary call as raw bytes (any service, metadata included) and,
per method, follows a plan of faults for the next calls:
  "drop_request":  answer UNAVAILABLE without forwarding (never executed);
  "drop_response": forward, let the server execute it, then answer
                   UNAVAILABLE instead of the response (the client cannot
                   know it was executed: the case exactly-once exists for);
  "aborted":       answer ABORTED without forwarding (what a server says for
                   a poisoned window).

    proxy = FaultProxy(f"localhost:{server_port}")
    proxy.plan("/tally.v1.Trainer/OptimStep", ["drop_response"])
    client = TrainingClient(proxy.target, "m")
    ...
    proxy.forwarded["/tally.v1.Trainer/OptimStep"]  # calls the server got
"""

import collections
import concurrent.futures
import threading

import grpc


class FaultProxy(grpc.GenericRpcHandler):

    def __init__(self, backend_target):
        self._backend = grpc.insecure_channel(
            backend_target,
            options=[("grpc.max_send_message_length", 256 << 20),
                     ("grpc.max_receive_message_length", 256 << 20)])
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=16),
            options=[("grpc.max_send_message_length", 256 << 20),
                     ("grpc.max_receive_message_length", 256 << 20)])
        self._server.add_generic_rpc_handlers([self])
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{port}"
        self._lock = threading.Lock()
        self._plans = collections.defaultdict(collections.deque)
        self.forwarded = collections.Counter()
        self.received = collections.Counter()
        self.last_metadata = {}
        self._server.start()

    def plan(self, method, faults):
        """Faults for the next calls of `method` ("/pkg.Service/Method"), one
        per call, in order; later calls pass through."""
        with self._lock:
            self._plans[method].extend(faults)

    def stop(self):
        self._server.stop(grace=None)
        self._backend.close()

    def service(self, handler_call_details):
        method = handler_call_details.method
        forward = self._backend.unary_unary(method)

        def handle(request, context):
            with self._lock:
                self.received[method] += 1
                fault = self._plans[method].popleft() if self._plans[method] else None
            if fault == "drop_request":
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              "fault proxy: request dropped")
            if fault == "aborted":
                context.abort(grpc.StatusCode.ABORTED,
                              "fault proxy: the window is poisoned")
            metadata = [(k, v) for k, v in context.invocation_metadata()
                        if not k.startswith("grpc-")]
            with self._lock:
                self.forwarded[method] += 1
                self.last_metadata[method] = dict(metadata)
            try:
                response = forward(request, timeout=context.time_remaining(),
                                   metadata=metadata)
            except grpc.RpcError as error:
                # The server's rich error details (its ErrorInfo reason) go
                # back to the client unchanged.
                context.set_trailing_metadata(
                    [(k, v) for k, v in error.trailing_metadata() or ()
                     if k == "grpc-status-details-bin"])
                context.abort(error.code(), error.details())
            if fault == "drop_response":
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              "fault proxy: response dropped")
            return response

        return grpc.unary_unary_rpc_method_handler(handle)
