package dev.toolproxy.authserver;

import java.time.Duration;
import java.util.ArrayList;
import java.util.UUID;
import java.util.concurrent.atomic.AtomicInteger;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;
import org.springframework.boot.SpringApplication;
import org.springframework.boot.autoconfigure.SpringBootApplication;
import org.springframework.context.annotation.Bean;
import org.springframework.core.annotation.Order;
import org.springframework.security.config.Customizer;
import org.springframework.security.config.annotation.web.builders.HttpSecurity;
import org.springframework.security.config.annotation.web.configurers.AbstractHttpConfigurer;
import org.springframework.security.core.userdetails.User;
import org.springframework.security.core.userdetails.UserDetailsService;
import org.springframework.security.oauth2.core.AuthorizationGrantType;
import org.springframework.security.oauth2.core.ClientAuthenticationMethod;
import org.springframework.security.oauth2.server.authorization.OAuth2TokenType;
import org.springframework.security.oauth2.server.authorization.authentication.OAuth2TokenExchangeAuthenticationToken;
import org.springframework.security.oauth2.server.authorization.client.InMemoryRegisteredClientRepository;
import org.springframework.security.oauth2.server.authorization.client.RegisteredClient;
import org.springframework.security.oauth2.server.authorization.client.RegisteredClientRepository;
import org.springframework.security.oauth2.server.authorization.config.annotation.web.configurers.OAuth2AuthorizationServerConfigurer;
import org.springframework.security.oauth2.server.authorization.settings.ClientSettings;
import org.springframework.security.oauth2.server.authorization.settings.TokenSettings;
import org.springframework.security.oauth2.server.authorization.token.JwtEncodingContext;
import org.springframework.security.oauth2.server.authorization.token.OAuth2TokenCustomizer;
import org.springframework.security.provisioning.InMemoryUserDetailsManager;
import org.springframework.security.web.SecurityFilterChain;
import org.springframework.web.bind.annotation.GetMapping;
import org.springframework.web.bind.annotation.RestController;

/**
 * A real Spring Authorization Server for toolproxy's credential tests: RFC 8693 token exchange with an actor
 * token, which it records in the new token's {@code act} claim (delegation). Clients: {@code agent-app} (the
 * agent's login, authorization code, user alice by form login), {@code toolproxy} (client credentials for its
 * own token, and token exchange). Its tokens carry the claims the proxy's jwt identity reads. It counts the
 * exchanges it issued at {@code GET /test/exchanges} (the tests' counter).
 */
@SpringBootApplication
@RestController
public class AuthServer {
    private static final Logger LOG = LoggerFactory.getLogger(AuthServer.class);
    private static final AtomicInteger EXCHANGES = new AtomicInteger();

    public static void main(String[] args) {
        SpringApplication.run(AuthServer.class, args);
    }

    @GetMapping("/test/exchanges")
    public int exchanges() {
        return EXCHANGES.get();
    }

    @Bean
    @Order(1)
    SecurityFilterChain authorizationServer(HttpSecurity http) throws Exception {
        OAuth2AuthorizationServerConfigurer server = OAuth2AuthorizationServerConfigurer.authorizationServer();
        http.securityMatcher(server.getEndpointsMatcher())
            .with(server, Customizer.withDefaults())
            .authorizeHttpRequests(a -> a.anyRequest().authenticated())
            .csrf(c -> c.ignoringRequestMatchers(server.getEndpointsMatcher()))
            .exceptionHandling(e -> e.authenticationEntryPoint(
                new org.springframework.security.web.authentication.LoginUrlAuthenticationEntryPoint("/login")));
        return http.build();
    }

    @Bean
    @Order(2)
    SecurityFilterChain login(HttpSecurity http) throws Exception {
        // A test server driven by a script: the login form without a CSRF token.
        http.authorizeHttpRequests(a -> a.requestMatchers("/test/**").permitAll().anyRequest().authenticated())
            .csrf(AbstractHttpConfigurer::disable)
            .formLogin(Customizer.withDefaults());
        return http.build();
    }

    @Bean
    UserDetailsService users() {
        return new InMemoryUserDetailsManager(
            User.withUsername("alice").password("{noop}" + System.getenv().getOrDefault("AUTHSERVER_USER_PASSWORD",
                "alice-password")).roles("USER").build());
    }

    @Bean
    RegisteredClientRepository clients() {
        String redirect = System.getenv().getOrDefault("AUTHSERVER_REDIRECT_URI", "http://127.0.0.1:1/callback");
        RegisteredClient agent = RegisteredClient.withId(UUID.randomUUID().toString())
            .clientId("agent-app")
            .clientSecret("{noop}" + System.getenv().getOrDefault("AUTHSERVER_AGENT_SECRET", "agent-secret"))
            .clientAuthenticationMethod(ClientAuthenticationMethod.CLIENT_SECRET_BASIC)
            .authorizationGrantType(AuthorizationGrantType.AUTHORIZATION_CODE)
            .redirectUri(redirect)
            .scope("crm.read")
            .clientSettings(ClientSettings.builder().requireAuthorizationConsent(false).build())
            .tokenSettings(TokenSettings.builder().accessTokenTimeToLive(Duration.ofMinutes(5)).build())
            .build();
        RegisteredClient proxy = RegisteredClient.withId(UUID.randomUUID().toString())
            .clientId("toolproxy")
            .clientSecret("{noop}" + System.getenv().getOrDefault("AUTHSERVER_PROXY_SECRET", "proxy-secret"))
            .clientAuthenticationMethod(ClientAuthenticationMethod.CLIENT_SECRET_BASIC)
            .clientAuthenticationMethod(ClientAuthenticationMethod.CLIENT_SECRET_POST)
            .authorizationGrantType(AuthorizationGrantType.CLIENT_CREDENTIALS)
            .authorizationGrantType(AuthorizationGrantType.TOKEN_EXCHANGE)
            .scope("crm.read")
            .tokenSettings(TokenSettings.builder().accessTokenTimeToLive(Duration.ofMinutes(5)).build())
            .build();
        return new InMemoryRegisteredClientRepository(agent, proxy);
    }

    @Bean
    OAuth2TokenCustomizer<JwtEncodingContext> claims() {
        return context -> {
            if (!OAuth2TokenType.ACCESS_TOKEN.equals(context.getTokenType())) {
                return;
            }
            if (context.getAuthorizationGrant() instanceof OAuth2TokenExchangeAuthenticationToken exchange) {
                if (!exchange.getAudiences().isEmpty()) {
                    context.getClaims().audience(new ArrayList<>(exchange.getAudiences()));
                }
                LOG.info("token exchange #{} for client {}", EXCHANGES.incrementAndGet(),
                         context.getRegisteredClient().getClientId());
            } else if ("agent-app".equals(context.getRegisteredClient().getClientId())) {
                // The agent's login is a token for the proxy, with the claims its jwt identity mode reads.
                context.getClaims().audience(java.util.List.of("toolproxy"))
                    .claim("tenant", "acme").claim("roles", "agent").claim("toolproxy_scopes", "tools:read tools:write");
            }
        };
    }
}
