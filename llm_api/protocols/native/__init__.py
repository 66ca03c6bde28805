"""The native API (``POST /predictions/<model>``, gRPC): its route."""
