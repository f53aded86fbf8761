package pki

import (
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// File modes: private keys are readable by their owner only; certificates
// are public.
const (
	keyFileMode  os.FileMode = 0o600
	certFileMode os.FileMode = 0o644
)

// Save writes the CA's certificate and key. The key file is 0600.
func (ca *CA) Save(certFile, keyFile string) error {
	keyDER, err := x509.MarshalPKCS8PrivateKey(ca.key)
	if err != nil {
		return fmt.Errorf("save CA: encode key: %w", err)
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	if err := writeFileAtomic(keyFile, keyPEM, keyFileMode); err != nil {
		return fmt.Errorf("save CA key: %w", err)
	}
	if err := writeFileAtomic(certFile, ca.certPEM, certFileMode); err != nil {
		return fmt.Errorf("save CA certificate: %w", err)
	}
	return nil
}

// LoadCA reads a CA written by Save (or any CA certificate with its PKCS#8,
// SEC 1 or PKCS#1 key), to issue more certificates.
func LoadCA(certFile, keyFile string) (*CA, error) {
	certDER, err := readPEM(certFile, "CERTIFICATE")
	if err != nil {
		return nil, fmt.Errorf("load CA: %w", err)
	}
	keyDER, keyType, err := readAnyPEM(keyFile)
	if err != nil {
		return nil, fmt.Errorf("load CA: %w", err)
	}
	key, err := parsePrivateKey(keyType, keyDER)
	if err != nil {
		return nil, fmt.Errorf("load CA key %s: %w", keyFile, err)
	}
	ca, err := newCA(certDER, key)
	if err != nil {
		return nil, fmt.Errorf("load CA %s: %w", certFile, err)
	}
	return ca, nil
}

// Save writes the certificate and its key. The key file is 0600.
func (kp *KeyPair) Save(certFile, keyFile string) error {
	if err := writeFileAtomic(keyFile, kp.KeyPEM, keyFileMode); err != nil {
		return fmt.Errorf("save key: %w", err)
	}
	if err := writeFileAtomic(certFile, kp.CertPEM, certFileMode); err != nil {
		return fmt.Errorf("save certificate: %w", err)
	}
	return nil
}

// LoadPool reads a PEM file of trusted CA certificates.
func LoadPool(caFile string) (*x509.CertPool, error) {
	data, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("read CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, fmt.Errorf("CA file %s: no PEM certificate in it", caFile)
	}
	return pool, nil
}

// writeFileAtomic writes through a temporary file in the same directory and
// renames it into place, so a crash never leaves half a key, and the file
// has its final mode before it holds a byte of the secret.
func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("mkdir %s: %w", dir, err)
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after the rename
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

func readPEM(path, wantType string) ([]byte, error) {
	der, typ, err := readAnyPEM(path)
	if err != nil {
		return nil, err
	}
	if typ != wantType {
		return nil, fmt.Errorf("%s: PEM block %q, want %q", path, typ, wantType)
	}
	return der, nil
}

// readAnyPEM returns the first PEM block of path. Errors name the file,
// never its content: a key must not reach a log through an error message.
func readAnyPEM(path string) ([]byte, string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, "", fmt.Errorf("read %w", err)
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, "", fmt.Errorf("%s: no PEM block", path)
	}
	return block.Bytes, block.Type, nil
}

func parsePrivateKey(typ string, der []byte) (crypto.Signer, error) {
	var (
		k   any
		err error
	)
	switch typ {
	case "PRIVATE KEY":
		k, err = x509.ParsePKCS8PrivateKey(der)
	case "EC PRIVATE KEY":
		k, err = x509.ParseECPrivateKey(der)
	case "RSA PRIVATE KEY":
		k, err = x509.ParsePKCS1PrivateKey(der)
	default:
		return nil, fmt.Errorf("PEM block %q is not a private key", typ)
	}
	if err != nil {
		return nil, errors.New("unparsable private key") // no detail: it may quote key bytes
	}
	s, ok := k.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("private key of type %T cannot sign", k)
	}
	return s, nil
}
