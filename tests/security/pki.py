"""A small certificate authority for tests, built with ``cryptography``: real X.509 CAs, leaf
certificates with kvtier's SAN URIs, expired and not-yet-valid ones, CRLs, written as PEM files.

Nothing here is a fake: the daemons and conductors under test load these files exactly as they
would load an operator's, and gRPC's TLS stack verifies them."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_UTC = datetime.UTC


def _now() -> datetime.datetime:
    return datetime.datetime.now(_UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass
class Ca:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.pem)
        return path

    def issue(self, common_name: str, *, uri: str | None = None, ips: tuple[str, ...] = ("127.0.0.1",),
              dns: tuple[str, ...] = ("localhost",), valid_from_s: float = -60.0,
              valid_for_s: float = 86400.0, serial: int | None = None) -> Leaf:
        """A leaf certificate for both TLS roles (serverAuth and clientAuth), with ``uri`` as a
        SAN URI (a kvtier identity) and the given IP and DNS SANs."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        sans += [x509.DNSName(d) for d in dns]
        if uri is not None:
            sans.append(x509.UniformResourceIdentifier(uri))
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial if serial is not None else x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(seconds=valid_from_s))
            .not_valid_after(now + datetime.timedelta(seconds=valid_from_s + valid_for_s))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self.key.public_key()), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False))
        return Leaf(common_name, key, builder.sign(self.key, hashes.SHA256()))

    def crl(self, revoked: list[int]) -> bytes:
        """A PEM CRL signed by this CA revoking ``revoked`` serials."""
        now = _now()
        builder = (x509.CertificateRevocationListBuilder()
                   .issuer_name(self.cert.subject)
                   .last_update(now - datetime.timedelta(minutes=1))
                   .next_update(now + datetime.timedelta(days=1)))
        for serial in revoked:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial)
                .revocation_date(now - datetime.timedelta(minutes=1)).build())
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@dataclass
class Leaf:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def serial(self) -> int:
        return self.cert.serial_number

    def write(self, directory: Path, stem: str | None = None) -> tuple[Path, Path]:
        """``<stem>.crt`` and ``<stem>.key`` in ``directory`` (replaced atomically)."""
        stem = stem or self.name
        cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
        for path, data in ((cert_path, self.cert.public_bytes(serialization.Encoding.PEM)),
                           (key_path, _pem_key(self.key))):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return cert_path, key_path


def make_ca(name: str = "kvtier test CA") -> Ca:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return Ca(name, key, cert)
