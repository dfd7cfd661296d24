"""Who may use each route: every route declares, in its own decorator, the least role
it needs (``dependencies=[VIEWER]``, ``[OPERATOR]``, ...; ``[PUBLIC]`` for the login
page and its static files). The declaration is a FastAPI dependency that refuses a
lower role with 403 and one sentence naming the role needed and the role held.

Who holds which role is decided before the app, by the server the request came in on
(``fusuma.api.server``): the UNIX socket's group is admin (``LocalAuth``); on TCP a bearer
token, or the dashboard session made from one, carries that token's role
(``TokenAuth``). A request that reaches a declared route without an identity is
refused (401): a door that forgot to say who came in opens nothing.

Every route is a ``RoleRoute``: one that declares no role (or two) cannot be made, and
each writes its role into the OpenAPI document (``x-fusuma-role``) and its
description, where ``tests/unit/test_api_roles.py`` walks it; ``check_roles(app)``
refuses an app holding a route made any other way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.routing import APIRoute, iter_route_contexts
from starlette.exceptions import HTTPException

from fusuma.frozen import frozen
from fusuma.state.records import TokenRecord
from fusuma.state.roles import Role

OPENAPI_KEY = "x-fusuma-role"
PUBLIC_ROLE = "public"       # what x-fusuma-role says of a route that needs no identity


@frozen
class Identity:
    """Who sent a request: ``name`` for the 403 sentence, the role held, and the
    token's name when a token (or a session made from one) carried it."""

    name: str
    role: Role
    token: str | None = None


def local(group: str) -> Identity:
    """Whoever reached the UNIX socket: root or a member of its group."""
    return Identity(f"the UNIX socket (group {group})", Role.ADMIN)


def token_identity(rec: TokenRecord) -> Identity:
    return Identity(f"token {rec.name!r}", rec.role, rec.name)


def identity_of(request: Request) -> Identity | None:
    got = request.scope.get("state", {}).get("identity")
    return got if isinstance(got, Identity) else None


def refuse(what: str, needed: Role, who: Identity) -> HTTPException:
    """The 403 for ``who``, whose role is below ``needed`` for ``what``."""
    return HTTPException(403, f"{what} needs the {needed} role; {who.name} has the "
                              f"{who.role} role.")


def _who(request: Request) -> Identity:
    who = identity_of(request)
    if who is None:
        raise HTTPException(401, "this request carries no identity (neither the UNIX "
                                 "socket nor a token); it is refused.")
    return who


def require(request: Request, needed: Role, what: str) -> None:
    """Inside a route: refuse one part of a request (a field) that needs more than the
    route declares, with the route's own 403 sentence."""
    who = _who(request)
    if not who.role.includes(needed):
        raise refuse(what, needed, who)


class Needs:
    """A route's declared role (None: public). Called by FastAPI before the route's
    own parameters are read."""

    def __init__(self, role: Role | None) -> None:
        self.role = role

    def __call__(self, request: Request) -> None:
        if self.role is not None:
            require(request, self.role, f"{request.method} {request.url.path}")

    @property
    def label(self) -> str:
        return PUBLIC_ROLE if self.role is None else self.role.value


PUBLIC = Depends(Needs(None))
METRICS = Depends(Needs(Role.METRICS))
VIEWER = Depends(Needs(Role.VIEWER))
OPERATOR = Depends(Needs(Role.OPERATOR))
ADMIN = Depends(Needs(Role.ADMIN))


def declared(route: Any) -> Needs:
    """The role ``route`` declares; a RuntimeError (a bug, not a user's mistake) when it
    declares none or more than one."""
    if not isinstance(route, APIRoute):
        raise RuntimeError(f"route {getattr(route, 'path', route)!r} is not an APIRoute, "
                           "so it cannot declare a role; add it with a router's decorator "
                           "and dependencies=[ROLE].")
    needs = [dep.dependency for dep in route.dependencies
             if isinstance(dep.dependency, Needs)]
    if len(needs) != 1:
        methods = ",".join(sorted(route.methods or ()))
        raise RuntimeError(f"route {methods} {route.path} declares {len(needs)} roles; "
                           "give it exactly one: dependencies=[PUBLIC | METRICS | VIEWER "
                           "| OPERATOR | ADMIN] (fusuma.api.roles).")
    return needs[0]


class RoleRoute(APIRoute):
    """The class of every route of the API (``APIRouter(route_class=RoleRoute)``): one
    that declares no role, or two, cannot be made; its role is written into the OpenAPI
    document (``x-fusuma-role``) and its description."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        need = declared(self)
        self.openapi_extra = {**(self.openapi_extra or {}), OPENAPI_KEY: need.label}
        says = ("Open to anyone, without a token." if need.role is None
                else "Needs the admin role." if need.role is Role.ADMIN
                else f"Needs the {need.label} role or above.")
        self.description = f"{says}\n\n{self.description or ''}".strip()


def check_roles(app: FastAPI) -> None:
    """Refuse (RuntimeError) an app holding a route that is not a RoleRoute: one added
    another way (a mount, FastAPI's own pages) would have no declared role."""
    for ctx in iter_route_contexts(app.routes):
        route = ctx.original_route
        if not isinstance(route, RoleRoute):
            raise RuntimeError(f"route {getattr(route, 'path', route)!r} was not made by "
                               "a router with route_class=RoleRoute, so it declares no "
                               "role (fusuma.api.roles).")
