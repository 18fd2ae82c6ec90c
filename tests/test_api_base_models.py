"""/api/v1/base-models/: CRUD and ownership."""

from __future__ import annotations

import pytest

from webapp.catalog.models import BaseModel

pytestmark = pytest.mark.django_db


def test_create_list_update_delete(api, user):
    created = api.post("/api/v1/base-models/", {"name": "demo", "path": "/models/demo"}, format="json")
    assert created.status_code == 201, created.content
    pk = created.json()["id"]
    assert BaseModel.objects.get(pk=pk).owner == user
    assert [m["name"] for m in api.get("/api/v1/base-models/").json()["results"]] == ["demo"]
    assert api.patch(f"/api/v1/base-models/{pk}/", {"description": "tiny"}, format="json").status_code == 200
    assert BaseModel.objects.get(pk=pk).description == "tiny"
    assert api.delete(f"/api/v1/base-models/{pk}/").status_code == 204
    assert not BaseModel.objects.exists()


def test_name_is_required_and_unique_per_owner(api, other_api):
    assert api.post("/api/v1/base-models/", {"path": "/x"}, format="json").status_code == 400
    assert api.post("/api/v1/base-models/", {"name": "m", "path": "/x"}, format="json").status_code == 201
    # another user may use the same name
    assert other_api.post("/api/v1/base-models/", {"name": "m", "path": "/y"}, format="json").status_code == 201
    assert BaseModel.objects.count() == 2


def test_other_user_cannot_touch(api, other_api):
    pk = api.post("/api/v1/base-models/", {"name": "m", "path": "/x"}, format="json").json()["id"]
    assert other_api.get(f"/api/v1/base-models/{pk}/").status_code == 404
    assert other_api.delete(f"/api/v1/base-models/{pk}/").status_code == 404
    assert BaseModel.objects.filter(pk=pk).exists()


def test_token_endpoint_trades_password_for_token(client, user):
    from rest_framework.test import APIClient

    anonymous = APIClient()
    assert anonymous.post("/api/v1/auth/token/", {"username": "alice", "password": "wrong"}).status_code == 400
    response = anonymous.post("/api/v1/auth/token/", {"username": "alice", "password": "alice-password-1"})
    assert response.status_code == 200
    anonymous.credentials(HTTP_AUTHORIZATION=f"Token {response.json()['token']}")
    assert anonymous.get("/api/v1/base-models/").status_code == 200
