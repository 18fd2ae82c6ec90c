from django.urls import path, re_path

from webapp.ui import catalog_views, views

urlpatterns = [
    path("", views.runs_list, name="runs"),
    path("runs/new/", views.run_new, name="run-new"),
    path("runs/compare/", views.compare, name="compare"),
    path("runs/<int:run_id>/", views.run_detail, name="run"),
    re_path(r"^runs/(?P<run_id>[0-9]+)/(?P<action>start|pause|resume|cancel)/$", views.run_action, name="run-action"),
    path("runs/<int:run_id>/trajectories/", views.trajectories, name="run-trajectories"),
    path("runs/<int:run_id>/groups/<str:key>/", views.group_detail, name="group"),
    path("trajectories/<int:trajectory_id>/", views.trajectory_detail, name="trajectory"),
    path("versions/", views.versions, name="versions"),
    path("versions/<int:version_id>/", views.version_detail, name="version"),
    path("versions/<int:version_id>/promote/", views.version_promote, name="version-promote"),
    path("base-models/<int:base_model_id>/rollback/", views.alias_rollback, name="alias-rollback"),
    path("domains/", catalog_views.domains_list, name="domains"),
    path("domains/new/", catalog_views.domain_new, name="domain-new"),
    path("domains/packs/", catalog_views.domain_packs, name="domain-packs"),
    path("domains/<int:domain_id>/", catalog_views.domain_detail, name="domain"),
    path("examples/<str:name>.jsonl", catalog_views.example_tasks, name="example-tasks"),
    path("verifiers/", catalog_views.verifiers_list, name="verifiers"),
    path("verifiers/new/", catalog_views.verifier_new, name="verifier-new"),
    path("verifiers/<int:verifier_id>/", catalog_views.verifier_detail, name="verifier"),
    path("verifiers/<int:verifier_id>/calibrate/", catalog_views.verifier_calibrate, name="verifier-calibrate"),
    path("base-models/", catalog_views.base_models, name="base-models"),
]
