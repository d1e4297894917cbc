"""Throw-away PEM files for mutual-TLS tests: a CA, a server certificate for 127.0.0.1, a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def write_test_certificates(directory: Path, dns_names: tuple[str, ...] = ()) -> dict[str, Path]:
  """PEM files in `directory`; the server certificate also names `dns_names` (wildcards allowed)."""
  from cryptography import x509
  from cryptography.hazmat.primitives import hashes, serialization
  from cryptography.hazmat.primitives.asymmetric import ec
  from cryptography.x509.oid import NameOID

  now = datetime.datetime.now(datetime.timezone.utc)

  def make(name: str, issuer_key=None, issuer_name=None, ca=False, san=None):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
      builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert

  ca_key, ca_cert = make("streamrl test CA", ca=True)
  server_key, server_cert = make("trainer", ca_key, ca_cert.subject,
                                 san=[x509.DNSName("localhost"), *map(x509.DNSName, dns_names), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
  client_key, client_cert = make("sampler", ca_key, ca_cert.subject)
  out = {}
  for name, key, cert in (("server", server_key, server_cert), ("client", client_key, client_cert)):
    out[f"{name}_cert"] = directory / f"{name}.pem"
    out[f"{name}_key"] = directory / f"{name}.key"
    out[f"{name}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out[f"{name}_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
  out["ca"] = directory / "ca.pem"
  out["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
  return out
