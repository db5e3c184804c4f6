"""Operations: what operators and the fleet's housekeeping do to a pipeline beyond the wire
contract: broadcast control commands, housekeeping (gc, retention), backlog, status, dead letters,
repair, and a request's trace."""
