"""Security: least-privilege Redis ACL users per role (:mod:`.acl`)."""
