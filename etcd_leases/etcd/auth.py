"""Username/password auth: a simple token per member, and the metadata of each call.

etcd's simple tokens are valid only on the member that issued them and expire (5 min
by default): a call refused with "invalid auth token" forgets the token, and the
next :meth:`Auth.metadata` logs in again.
"""

from __future__ import annotations

import grpc.aio

from etcd_leases.etcd.members import Members
from etcd_leases.etcd.wire import etcd_leases_wire_pb2 as pb

__all__ = ["Auth", "Metadata"]

# gRPC's own type, built once per token: it takes a tuple too, but checks and copies
# it on every call.
Metadata = grpc.aio.Metadata
_NO_TOKEN = Metadata(("hasleader", "true"))


class Auth:
    """The tokens of one client, per endpoint (no login without a username)."""

    def __init__(
        self, members: Members, username: str | None, password: str | None, timeout: float
    ) -> None:
        self._members = members
        self._username = username
        self._password = password
        self._timeout = timeout
        self._tokens: dict[int, str] = {}
        self._with_token: dict[int, Metadata] = {}

    @property
    def enabled(self) -> bool:
        return self._username is not None

    async def metadata(
        self, index: int | None = None, *, login_timeout: float | None = None
    ) -> Metadata:
        """Request metadata for endpoint ``index``: fail fast without a leader; the token.

        A login waits ``login_timeout`` seconds at most (``None``: the client's timeout):
        a caller with a share of the timeout per member passes its share, so a member
        that froze before answering a login costs no more than one that froze later.
        """
        if self._username is None:
            return _NO_TOKEN
        index = self._members.preferred() if index is None else index
        if index not in self._tokens:
            await self._authenticate(
                index, self._timeout if login_timeout is None else login_timeout
            )
        metadata = self._with_token.get(index)
        if metadata is None:
            metadata = self._with_token[index] = Metadata(
                ("hasleader", "true"), ("token", self._tokens[index])
            )
        return metadata

    def invalidate(self, index: int | None = None) -> None:
        """Forget the token endpoint ``index`` refused; :meth:`metadata` logs in again."""
        index = self._members.preferred() if index is None else index
        self._tokens.pop(index, None)
        self._with_token.pop(index, None)

    async def _authenticate(self, index: int, timeout: float) -> None:
        assert self._username is not None and self._password is not None
        request = pb.AuthenticateRequest(name=self._username, password=self._password)
        call = self._members.channel(index).unary_unary(
            "/etcdserverpb.Auth/Authenticate",
            request_serializer=pb.AuthenticateRequest.SerializeToString,
            response_deserializer=pb.AuthenticateResponse.FromString,
        )
        response: pb.AuthenticateResponse = await call(request, timeout=timeout)
        self._tokens[index] = response.token
        self._with_token.pop(index, None)
