// A real OpenID provider for fort's oidc tests and benchmark: npm's certified
// `oidc-provider` library with dynamic client registration (RFC 7591) behind an initial
// access token, client management (RFC 7592) and the client_credentials grant, its
// storage in memory (an unbounded Map: the library's own memory store forgets entries
// past 1000, fewer than a benchmark registers).
//
//   FORT_OIDC_PROVIDER_DIR   where `npm install oidc-provider` put node_modules (required)
//   FORT_OIDC_PORT           the port on 127.0.0.1 (required)
//   FORT_OIDC_TOKEN_FILE     a file holding the initial access token (required)
//   FORT_OIDC_TLS_CERT/_KEY  PEM files: serve https with them; unset: http
//
// Prints "listening <issuer>" once it accepts connections.
import { readFileSync } from 'node:fs';
import http from 'node:http';
import https from 'node:https';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const env = (name) => {
  const value = process.env[name];
  if (!value) {
    console.error(`server.mjs: ${name} is not set`);
    process.exit(2);
  }
  return value;
};

const dir = env('FORT_OIDC_PROVIDER_DIR');
const port = Number(env('FORT_OIDC_PORT'));
const initialAccessToken = readFileSync(env('FORT_OIDC_TOKEN_FILE'), 'utf8').trim();
const certFile = process.env.FORT_OIDC_TLS_CERT;
const keyFile = process.env.FORT_OIDC_TLS_KEY;
const issuer = `${certFile ? 'https' : 'http'}://127.0.0.1:${port}`;

const { default: Provider } = await import(
  pathToFileURL(join(dir, 'node_modules', 'oidc-provider', 'lib', 'index.js')).href
);

const stores = new Map();
class MemoryAdapter {
  constructor(model) {
    if (!stores.has(model)) stores.set(model, new Map());
    this.store = stores.get(model);
  }

  async upsert(id, payload, expiresIn) {
    const expires = expiresIn ? Date.now() + expiresIn * 1000 : Infinity;
    this.store.set(id, { payload, expires });
  }

  async find(id) {
    const found = this.store.get(id);
    if (!found) return undefined;
    if (found.expires <= Date.now()) {
      this.store.delete(id);
      return undefined;
    }
    return found.payload;
  }

  async findByUserCode(userCode) {
    for (const { payload } of this.store.values()) {
      if (payload.userCode === userCode) return payload;
    }
    return undefined;
  }

  async findByUid(uid) {
    for (const { payload } of this.store.values()) {
      if (payload.uid === uid) return payload;
    }
    return undefined;
  }

  async consume(id) {
    const found = this.store.get(id);
    if (found) found.payload.consumed = Math.floor(Date.now() / 1000);
  }

  async destroy(id) {
    this.store.delete(id);
  }

  async revokeByGrantId(grantId) {
    for (const [id, { payload }] of this.store) {
      if (payload.grantId === grantId) this.store.delete(id);
    }
  }
}

const provider = new Provider(issuer, {
  adapter: MemoryAdapter,
  clients: [],
  scopes: ['openid', 'email', 'profile', 'groups', 'offline_access'],
  features: {
    devInteractions: { enabled: false },
    registration: { enabled: true, initialAccessToken },
    registrationManagement: { enabled: true },
    clientCredentials: { enabled: true },
  },
});

const app = provider.callback();
const server = certFile
  ? https.createServer({ cert: readFileSync(certFile), key: readFileSync(keyFile) }, app)
  : http.createServer(app);
server.listen(port, '127.0.0.1', () => {
  console.log(`listening ${issuer}`);
});
process.on('SIGTERM', () => server.close(() => process.exit(0)));
